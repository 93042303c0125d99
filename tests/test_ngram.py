"""Prompt-lookup proposer: longest suffix match, earliest occurrence, vLLM's bounds, the tokens it keeps."""
from __future__ import annotations

import pytest
import torch

from specdec.proposers import NgramProposer, make_proposer
from specdec.types import ProposeRequest, SamplingParams


def propose(proposer: NgramProposer, token_ids: list[int], k: int) -> list[int]:
    request = ProposeRequest(seq_id="s", position=0, token_ids=token_ids, num_tokens=k, sampling=SamplingParams(), seed=0)
    (proposal,) = proposer.propose([request])
    assert proposal.probs is None and proposal.token_ids.dtype == torch.long
    return proposal.token_ids.tolist()


def test_min_tokens_ban_cuts_the_proposal_at_a_banned_draft():
    tokens = [5, 6, 0, 7, 8, 5, 6]  # [5, 6] recurs: the continuation is [0, 7, 8]
    request = ProposeRequest("s", 0, tokens, 3, SamplingParams(), 0, num_banned_tokens=1, banned_token_ids=(0,))
    assert NgramProposer(2, 2).propose([request])[0].token_ids.tolist() == []
    request = ProposeRequest("s", 0, tokens, 3, SamplingParams(), 0, num_banned_tokens=1, banned_token_ids=(7,))
    assert NgramProposer(2, 2).propose([request])[0].token_ids.tolist() == [0, 7, 8]  # 7 is banned at index 0 only
    request = ProposeRequest("s", 0, tokens, 3, SamplingParams(), 0, num_banned_tokens=2, banned_token_ids=(7,))
    assert NgramProposer(2, 2).propose([request])[0].token_ids.tolist() == [0]


def test_longest_match_wins():
    # Suffix [1, 2, 3] occurs once at index 4 (followed by 7); its 1-gram [3] occurs first at index 0 (then 9).
    tokens = [3, 9, 9, 9, 1, 2, 3, 7, 7, 0, 2, 3, 1, 2, 3]
    assert propose(NgramProposer(1, 3), tokens, 2) == [7, 7]
    assert propose(NgramProposer(1, 1), tokens, 2) == [9, 9]


def test_earliest_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(NgramProposer(2, 2), tokens, 1) == [1]


def test_proposes_up_to_k_tokens_and_stops_at_sequence_end():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert propose(NgramProposer(2, 2), tokens, 3) == [3, 4, 5]
    # Match at index 5 (suffix [1]) -- earliest is index 0, followed by 2, 3, 4, 5, 1, 2.
    assert propose(NgramProposer(1, 1), [1, 2, 3, 4, 5, 1], 10) == [2, 3, 4, 5, 1]
    # The continuation of the only earlier occurrence may run into the suffix itself.
    assert propose(NgramProposer(1, 1), [4, 4], 5) == [4]


def test_min_bound_rejects_short_matches():
    tokens = [8, 1, 2, 9, 3, 2]  # only [2] repeats
    assert propose(NgramProposer(1, 3), tokens, 2) == [9, 3]
    assert propose(NgramProposer(2, 3), tokens, 2) == []


def test_max_bound_caps_the_match_length():
    # Suffix [1, 2, 3] first occurs at index 3 (then 4); with max 2 the suffix [2, 3] is tried
    # instead, and it first occurs at index 0 (then 6).
    tokens = [2, 3, 6, 1, 2, 3, 4, 0, 1, 2, 3]
    assert propose(NgramProposer(2, 3), tokens, 1) == [4]
    assert propose(NgramProposer(1, 2), tokens, 1) == [6]


def test_no_match_and_edge_cases_propose_nothing():
    assert propose(NgramProposer(1, 4), [1, 2, 3, 4], 3) == []
    assert propose(NgramProposer(1, 4), [7], 3) == []
    assert propose(NgramProposer(1, 4), [7, 7, 7], 0) == []


def test_vllm_defaults_and_mirroring():
    assert NgramProposer().config.prompt_lookup_min == 5 and NgramProposer().config.prompt_lookup_max == 5
    only_min = NgramProposer(prompt_lookup_min=3).config
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    only_max = NgramProposer(prompt_lookup_max=4).config
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize(
    ("lookup_min", "lookup_max", "named"),
    [
        (0, 3, "prompt_lookup_min"),
        (2, 0, "prompt_lookup_max"),
        (4, 3, "prompt_lookup_min"),
        (-1, None, "prompt_lookup_min"),
    ],
)
def test_invalid_bounds_raise_naming_the_parameter(lookup_min, lookup_max, named):
    with pytest.raises(ValueError, match=named):
        NgramProposer(lookup_min, lookup_max)


def test_factory_builds_ngram_and_rejects_unknown_methods():
    proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=3)
    assert isinstance(proposer, NgramProposer) and proposer.config.prompt_lookup_max == 3
    with pytest.raises(ValueError, match="method must be one of"):
        make_proposer("eagle")


def test_position_based_requests_propose_what_the_whole_sequence_does():
    """Each request brings only new tokens (some steps none at all); drafts equal a fresh proposer's."""
    proposer = NgramProposer(1, 3)
    sequence = [1, 2, 3, 4, 1, 2]
    sent = 0
    for new in ([3, 9], [], [1, 2, 3], [4, 4], [], [1], [2, 3]):
        sequence += new
        if not new and sent:  # a step that drafts nothing sends nothing; the next request catches up
            continue
        request = ProposeRequest("s", sent, sequence[sent:], 3, SamplingParams(), 0)
        drafts = proposer.propose([request])[0].token_ids.tolist()
        assert drafts == propose(NgramProposer(1, 3), sequence, 3)
        sent = len(sequence)
    assert proposer.num_active_sequences == 1
    # A rejected tail is cut back: position 4 drops what was held past it.
    cut = ProposeRequest("s", 4, [7, 7], 2, SamplingParams(), 0)
    assert proposer.propose([cut])[0].token_ids.tolist() == propose(NgramProposer(1, 3), sequence[:4] + [7, 7], 2)


def test_a_gap_or_an_empty_sequence_is_refused_by_name():
    proposer = NgramProposer(1, 2)
    with pytest.raises(ValueError, match=r"seq 'x': position 2 is past the 0 tokens the proposer holds"):
        proposer.propose([ProposeRequest("x", 2, [1], 1, SamplingParams(), 0)])
    with pytest.raises(ValueError, match=r"seq 'x': token_ids is empty at position 0"):
        proposer.propose([ProposeRequest("x", 0, [], 1, SamplingParams(), 0)])
    proposer.propose([ProposeRequest("x", 0, [1, 2, 1], 1, SamplingParams(), 0)])
    with pytest.raises(ValueError, match=r"seq 'x': position 5 is past the 3 tokens"):
        proposer.propose([ProposeRequest("x", 5, [2], 1, SamplingParams(), 0)])
    with pytest.raises(ValueError, match=r"seq 'x': num_tokens must be >= 0, got -1"):
        proposer.propose([ProposeRequest("x", 3, [2], -1, SamplingParams(), 0)])


def test_release_frees_the_tokens():
    proposer = NgramProposer(1, 2)
    proposer.release("unknown")
    assert propose(proposer, [1, 2, 1], 1) == [2]
    assert proposer.num_active_sequences == 1
    proposer.release("s")
    assert proposer.num_active_sequences == 0
    with pytest.raises(ValueError, match="position 3 is past the 0 tokens"):
        proposer.propose([ProposeRequest("s", 3, [2], 1, SamplingParams(), 0)])
