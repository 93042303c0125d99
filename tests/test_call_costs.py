"""specdec.call_costs: the cost grid's lookup, and measuring it on real verifiers and proposers."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec.call_costs import (
    PROPOSE_TOKENS,
    VERIFY_TOKENS,
    CallCosts,
    MeasuredOnce,
    measure_propose_costs,
    measure_verify_costs,
    sequence_counts,
)
from specdec.fast import FastDraftProposer, FastTargetVerifier
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.verifier import TargetVerifier

MODELS = Path(__file__).resolve().parents[1] / "models"  # the shipped pair: Llama checkpoints the fast engine loads


def linear_costs(sequences=(1, 2, 4), tokens=(1, 3, 5)) -> CallCosts:
    """1 ms a call plus 0.5 ms a row: exactly linear, so interpolation must reproduce it."""
    return CallCosts(sequences, tokens, tuple(tuple(1e-3 + 5e-4 * n * s for s in tokens) for n in sequences))


@pytest.mark.parametrize("n, s", [(1, 1), (3, 2), (4, 5), (2, 4), (8, 5), (4, 9), (6, 7)])
def test_lookup_is_exact_on_a_bilinear_grid_inside_and_beyond_it(n, s):
    def seconds(n, s):
        return 1e-3 + 2e-4 * n + 3e-4 * s

    costs = CallCosts((1, 2, 4), (1, 3, 5), tuple(tuple(seconds(n, s) for s in (1, 3, 5)) for n in (1, 2, 4)))
    assert costs(n, s) == pytest.approx(seconds(n, s))


def test_lookup_between_points_and_never_negative():
    costs = linear_costs()
    assert costs(2, 1) < costs(3, 1) < costs(4, 1)
    assert costs(2, 2) == pytest.approx((costs(2, 1) + costs(2, 3)) / 2)
    falling = CallCosts((1, 2), (1, 2), ((0.004, 0.003), (0.002, 0.001)))  # a noisy grid extrapolated down
    assert falling(8, 8) == 0.0


def test_a_one_point_axis_is_constant_along_it():
    costs = CallCosts((1,), (1, 3), ((0.001, 0.003),))
    assert costs(5, 3) == pytest.approx(0.003)


@pytest.mark.parametrize(
    "fields, message",
    [
        (((1, 1), (1,), ((0.1,), (0.1,))), "sequences must be increasing"),
        (((0, 2), (1,), ((0.1,), (0.1,))), "sequences must be increasing"),
        (((1,), (), ((),)), "tokens must be increasing"),
        (((1, 2), (1, 2), ((0.1, 0.2),)), "seconds must be 2 x 2"),
    ],
)
def test_a_malformed_grid_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        CallCosts(*fields)


@pytest.mark.parametrize("max_num_seqs, counts", [(1, (1,)), (2, (1, 2)), (8, (1, 2, 4, 8)), (6, (1, 2, 4, 6))])
def test_sequence_counts_end_at_max_num_seqs(max_num_seqs, counts):
    assert sequence_counts(max_num_seqs) == counts


def check_measured(costs: CallCosts, max_num_seqs: int, tokens) -> None:
    assert costs.sequences == sequence_counts(max_num_seqs) and costs.tokens == tuple(tokens)
    assert all(s > 0 for row in costs.seconds for s in row)
    assert "seqs" in costs.describe()


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_verify_costs_are_measured_on_scratch_sequences_that_are_released(target_model, engine):
    if engine == "fast":
        verifier = FastTargetVerifier(MODELS / "tiny-target", "float32", "cpu", 4)
    else:
        verifier = TargetVerifier(target_model)
    costs = measure_verify_costs(verifier, 4, verifier.vocab_size)
    check_measured(costs, 4, VERIFY_TOKENS)
    assert verifier.num_active_sequences == 0


@pytest.mark.parametrize("kind", ["fast", "hf", "ngram"])
def test_propose_costs_are_measured_on_scratch_sequences_that_are_released(draft_model, kind):
    if kind == "fast":
        proposer = FastDraftProposer(MODELS / "tiny-draft", "float32", "cpu", 2)
    elif kind == "hf":
        proposer = DraftModelProposer(draft_model)
    else:
        proposer = NgramProposer(1, 3)
    costs = measure_propose_costs(proposer, 2, getattr(proposer, "vocab_size", None))
    check_measured(costs, 2, PROPOSE_TOKENS)
    assert getattr(proposer, "num_active_sequences", 0) == 0
    if kind == "fast":  # more drafts take more passes
        assert costs(2, 8) > costs(2, 1)


def test_costs_are_measured_once_and_the_table_logged():
    lines, calls = [], []
    costs = linear_costs()
    once = MeasuredOnce("verify", lambda: calls.append(1) or costs, lines.append)
    assert once.get() is costs and once.get() is costs and len(calls) == 1
    assert len(lines) == 2 and "verify call costs measured in" in lines[1] and "seqs" in lines[1]
