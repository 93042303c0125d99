"""bench/phase.py: the row of figures one measured phase makes from its counters."""
from __future__ import annotations

import math

import pytest

from bench.client import JobResult
from bench.phase import PhaseMeasurement, phase_row, proposal_sources
from bench.stats import RequestTiming, parse_prometheus

SUFFIX_FIRST_METRICS = """\
spec_decode_num_steps{model="speculative_decoding"} 12
spec_decode_suffix_first_proposals{model="speculative_decoding",source="suffix"} 3
spec_decode_suffix_first_proposals{model="speculative_decoding",source="model"} 7
"""


def _measurement(metrics: str) -> PhaseMeasurement:
    timing = RequestTiming(sent=0.0, arrivals=[0.1, 0.2, 0.3], tokens=[1, 3, 2])
    return PhaseMeasurement([JobResult(timing, "abc", None, None)], 0.4, parse_prometheus(metrics), {})


def test_a_suffix_first_server_s_row_counts_each_source_s_proposals():
    row = phase_row(_measurement(SUFFIX_FIRST_METRICS))
    assert (row["proposals_from_suffix"], row["proposals_from_model"]) == (3, 7)
    assert row["suffix_share"] == pytest.approx(0.3)
    assert row["decode_steps"] == 11


def test_a_server_without_suffix_decoding_in_front_has_no_source_figures():
    row = phase_row(_measurement('spec_decode_num_steps{model="speculative_decoding"} 12\n'))
    assert not {"proposals_from_suffix", "proposals_from_model", "suffix_share"} & set(row)


def test_proposal_sources_reads_a_missing_source_as_none_made():
    assert proposal_sources({}) == {}
    assert proposal_sources({"suffix": 4.0}) == {"proposals_from_suffix": 4, "proposals_from_model": 0, "suffix_share": 1.0}
    assert math.isnan(proposal_sources({"suffix": 0.0, "model": 0.0})["suffix_share"])
