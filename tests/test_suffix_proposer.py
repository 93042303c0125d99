"""Suffix decoding proposer: what enters the global tree, what leaves it, and what it drafts."""
from __future__ import annotations

import pytest

from specdec.proposers import SuffixConfig, SuffixProposer
from specdec.types import ProposeRequest, SamplingParams


def ask(seq_id, position, token_ids, num_tokens=4, **kwargs) -> ProposeRequest:
    return ProposeRequest(seq_id=seq_id, position=position, token_ids=list(token_ids), num_tokens=num_tokens,
                          sampling=SamplingParams(), seed=0, **kwargs)  # fmt: skip


def drafts(proposer, *requests) -> list[list[int]]:
    return [p.token_ids.tolist() for p in proposer.propose(list(requests))]


def test_drafts_from_its_own_prompt():
    proposer = SuffixProposer()
    # "5 6 7 8" occurred; the sequence ends in "5 6": a 2-token match drafts "7 8"
    assert drafts(proposer, ask("a", 0, [5, 6, 7, 8, 1, 5, 6])) == [[7, 8]]
    # the next request brings only the new tokens
    assert drafts(proposer, ask("a", 7, [7])) == [[8, 1, 5]]


def test_no_match_drafts_nothing():
    proposer = SuffixProposer()
    assert drafts(proposer, ask("a", 0, [1, 2, 3, 4])) == [[]]


def test_a_completed_response_teaches_other_requests_and_a_cancelled_one_does_not():
    proposer = SuffixProposer()
    drafts(proposer, ask("a", 0, [9, 9]))
    proposer.release("a", response=[40, 41, 42, 43, 44])
    drafts(proposer, ask("b", 0, [9, 9]))
    proposer.release("b")  # cancelled or failed: no response
    assert proposer.stats().cached_responses == 1
    # a new request whose latest tokens are "40 41" drafts what followed them in "a"'s response
    assert drafts(proposer, ask("c", 0, [1, 40, 41])) == [[42, 43]]
    assert proposer.num_active_sequences == 1


def test_the_global_tree_stays_bounded_over_many_distinct_requests():
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=4, max_cached_requests=50))
    sizes = []
    for i in range(10_000):
        seq_id = f"r{i}"
        drafts(proposer, ask(seq_id, 0, [i % 97, i % 89, i % 83]))
        proposer.release(seq_id, response=[i % 101, i % 103, i % 107, i % 109, i % 113, i])
        sizes.append(proposer.stats().tree_nodes)
    stats = proposer.stats()
    assert stats.cached_responses == 50 and stats.cached_tokens == 50 * 6
    assert proposer.num_active_sequences == 0
    # 50 responses of 6 tokens hold at most 6 * 4 substrings each
    assert max(sizes) <= 50 * 6 * 4 and stats.approx_bytes > 0


def test_no_global_tree_when_max_cached_requests_is_zero():
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0))
    drafts(proposer, ask("a", 0, [1]))
    proposer.release("a", response=[1, 2, 3])
    assert proposer.stats().cached_responses == 0
    assert drafts(proposer, ask("b", 0, [7, 1, 2])) == [[]]


def test_a_resent_request_rebuilds_the_sequence_from_its_position():
    proposer = SuffixProposer()
    drafts(proposer, ask("a", 0, [5, 6, 7, 8, 5, 6]))
    # the same request sent again (a failed batch is retried per sequence): same drafts
    assert drafts(proposer, ask("a", 4, [5, 6])) == [[7, 8]]
    assert drafts(proposer, ask("a", 0, [5, 6, 7, 8, 5, 6])) == [[7, 8]]


def test_banned_drafts_are_cut():
    proposer = SuffixProposer()
    request = ask("a", 0, [5, 6, 7, 8, 5, 6], num_banned_tokens=2, banned_token_ids=(8,))
    assert drafts(proposer, request) == [[7]]


def test_num_tokens_limits_the_draft():
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=10))
    assert drafts(proposer, ask("a", 0, [1, 2, 3, 4, 5, 1, 2], num_tokens=2)) == [[3, 4]]
    assert drafts(proposer, ask("b", 0, [1, 2, 3, 4, 5, 1, 2], num_tokens=0)) == [[]]


def test_requests_that_do_not_fit_are_refused():
    proposer = SuffixProposer()
    with pytest.raises(ValueError, match="position 3 is past"):
        proposer.propose([ask("a", 3, [1])])


@pytest.mark.parametrize(
    "field, value",
    [("max_tree_depth", 0), ("max_cached_requests", -1), ("max_spec_factor", 0.0), ("min_token_prob", 1.5)],
)
def test_bad_settings_are_refused_by_their_vllm_names(field, value):
    with pytest.raises(ValueError, match=f"suffix_decoding_{field}"):
        SuffixConfig(**{field: value})
