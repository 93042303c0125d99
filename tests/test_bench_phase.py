"""bench/phase.py: the row of figures one measured phase makes from its counters."""
from __future__ import annotations

import math

import pytest

from bench.client import JobResult
from bench.phase import PhaseMeasurement, phase_row
from bench.stats import RequestTiming, parse_prometheus, source_figures

SUFFIX_FIRST_METRICS = """\
spec_decode_num_steps{model="speculative_decoding"} 12
spec_decode_suffix_first_proposals{model="speculative_decoding",source="suffix"} 3
spec_decode_suffix_first_proposals{model="speculative_decoding",source="model"} 7
spec_decode_suffix_first_draft_tokens{model="speculative_decoding",source="suffix"} 24
spec_decode_suffix_first_draft_tokens{model="speculative_decoding",source="model"} 28
spec_decode_suffix_first_accepted_tokens{model="speculative_decoding",source="suffix"} 15
spec_decode_suffix_first_accepted_tokens{model="speculative_decoding",source="model"} 14
"""


def _measurement(metrics: str) -> PhaseMeasurement:
    timing = RequestTiming(sent=0.0, arrivals=[0.1, 0.2, 0.3], tokens=[1, 3, 2])
    return PhaseMeasurement([JobResult(timing, "abc", None, None)], 0.4, parse_prometheus(metrics), {})


def test_a_suffix_first_server_s_row_has_each_source_s_steps_and_accepted_tokens():
    row = phase_row(_measurement(SUFFIX_FIRST_METRICS))
    assert (row["proposals_from_suffix"], row["proposals_from_model"]) == (3, 7)
    assert row["suffix_share"] == pytest.approx(0.3)
    assert (row["accepted_per_step_suffix"], row["accepted_per_step_model"]) == pytest.approx((5.0, 2.0))
    assert row["decode_steps"] == 11


def test_a_server_without_suffix_decoding_in_front_has_no_source_figures():
    row = phase_row(_measurement('spec_decode_num_steps{model="speculative_decoding"} 12\n'))
    assert not [key for key in row if "suffix" in key or key.startswith("proposals_from")]


def test_a_source_that_drafted_nothing_has_no_acceptance_figure():
    assert source_figures({}) == {}
    row = source_figures({"suffix": (4, 20, 9)})
    assert (row["proposals_from_suffix"], row["proposals_from_model"], row["suffix_share"]) == (4, 0, 1.0)
    assert row["accepted_per_step_suffix"] == 2.25 and math.isnan(row["accepted_per_step_model"])
    assert math.isnan(source_figures({"suffix": (0, 0, 0), "model": (0, 0, 0)})["suffix_share"])


@pytest.mark.parametrize("stage", ["verify", "propose_verify"])
def test_the_sequences_per_forward_count_the_calls_that_verify(stage):
    """A step verifies in its verify call, or in one propose_verify call where the draft runs beside the target."""
    row = phase_row(_measurement('spec_decode_num_steps{model="speculative_decoding"} 12\n'
                                 f'spec_decode_stage_calls{{model="speculative_decoding",stage="{stage}"}} 4\n'
                                 'spec_decode_stage_calls{model="speculative_decoding",stage="propose"} 3\n'))
    assert row["target_sequences_per_execution"] == 3.0
