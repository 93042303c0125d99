"""Sampled steps with q and p going straight to the rejection sampler (specdec_triton.sample_hop).

Layered: the sampler's store of held q alone; then the real ``model.py`` of draft_proposer,
target_verifier and rejection_sampler, loaded in-process as ``test_model_inputs`` does,
with each model's request to the sampler answered by the loaded sampler: a sequence
sampled through the hop gets exactly the tokens (and log probabilities) the same seeds
give when q and p come back and are sent to the sampler by hand.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.held_draft_probs import HeldDraftProbs
from specdec.penalties import emitted_log_probs
from specdec.types import (
    ProposeRequest, SampleCall, SampleHere, SampleResult, SamplingParams, VerifyRequest, VerifyResult,
)  # fmt: skip
from specdec_triton import sample_hop, wire
from specdec_triton.internal import SECRET_INPUT, boot_secret
from specdec_triton.plumbing import RequestError
from test_model_inputs import fake_pb_utils, load_model  # noqa: F401  (fake_pb_utils: the autouse fixture)

SAMPLED = SamplingParams(temperature=1.0)
PROMPT = [5, 17, 99, 3, 250, 17, 99, 8]
K = 3


# --- the store ---------------------------------------------------------------------------------


def test_held_probs_are_taken_only_for_the_drafts_they_were_drawn_for():
    held = HeldDraftProbs()
    q = torch.rand(2, 8)
    held.hold("a", [3, 4], q)
    assert held.take("a", [3, 4]) is q
    assert torch.equal(held.take("a", [3]), q[:1])  # drafts a grammar cut after the first
    with pytest.raises(ValueError, match=r"'a'.*drafts \[3, 4\].*\[3, 5\]"):
        held.take("a", [3, 5])
    with pytest.raises(ValueError, match=r"'b': no draft distribution"):
        held.take("b", [3, 4])
    with pytest.raises(ValueError, match="one row per draft"):
        held.hold("a", [3], q)


def test_held_probs_are_replaced_discarded_and_expire():
    now = [0.0]
    held = HeldDraftProbs(ttl_s=10.0, clock=lambda: now[0])
    held.hold("a", [1], torch.rand(1, 4))
    newer = torch.rand(1, 4)
    held.hold("a", [1], newer)  # the previous step's q is stale
    assert held.take("a", [1]) is newer and len(held) == 1
    held.discard(["a", "never-held"])
    assert len(held) == 0
    held.hold("old", [1], torch.rand(1, 4))
    now[0] = 11.0
    held.hold("new", [2], torch.rand(1, 4))  # a hold drops what outlived the ttl
    assert len(held) == 1
    with pytest.raises(ValueError, match="'old'"):
        held.take("old", [1])


# --- the wire, both ends -----------------------------------------------------------------------


def test_verify_sample_inputs_round_trip_and_verdicts_come_back_per_sequence():
    requests = [
        VerifyRequest("g", 4, [7], 1, SamplingParams()),
        VerifyRequest("s", 9, [7, 8, 9], 3, SAMPLED, log_probs=True, sample_here=SampleHere(11, True, position=5)),
        VerifyRequest("t", 2, [1, 2], 2, SAMPLED, sample_here=SampleHere(12, False)),
    ]
    inputs = sample_hop.verify_sample_inputs(requests)
    plain = [VerifyRequest(r.seq_id, r.position, r.token_ids, r.num_logits, r.sampling, log_probs=r.log_probs)
             for r in requests]  # fmt: skip
    assert sample_hop.with_sample_here(plain, inputs) == requests
    assert sample_hop.verify_sample_inputs(plain) == {}

    results = [VerifyResult(torch.tensor([7])), VerifyResult(torch.tensor([8, 9, 4]), sampled=SampleResult(
        torch.tensor([8, 5]), 1, [-0.5, -1.5])), VerifyResult(torch.tensor([3, 4]), sampled=SampleResult(
        torch.tensor([2]), 0))]  # fmt: skip
    back = sample_hop.attach_sampled(requests, [VerifyResult(r.argmax) for r in results],
                                     sample_hop.sampled_outputs(results))  # fmt: skip
    assert back[0].sampled is None
    assert back[1].sampled.output_token_ids.tolist() == [8, 5] and back[1].sampled.num_accepted == 1
    assert back[1].sampled.log_probs == [-0.5, -1.5]
    assert back[2].sampled.output_token_ids.tolist() == [2] and back[2].sampled.log_probs is None


def test_a_verifier_that_skips_a_verdict_is_caught():
    requests = [VerifyRequest("s", 0, [1], 1, SAMPLED, sample_here=SampleHere(1))]
    outputs = sample_hop.sampled_outputs([VerifyResult(torch.tensor([1]))])  # no verdict
    with pytest.raises(RuntimeError, match="sampled sequences"):
        sample_hop.attach_sampled(requests, [VerifyResult(torch.tensor([1]))], outputs)


# --- the served models -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """The three models, each one's requests to rejection_sampler answered by the loaded sampler."""
    sampler, draft, target = load_model("rejection_sampler"), load_model("draft_proposer"), load_model("target_verifier")
    sent = []

    def send(inputs):
        sent.append(sorted(inputs))
        return sampler._sample({**inputs, **wire.secret_input(boot_secret())})

    draft.send_to_sampler = target.send_to_sampler = send
    return sampler, draft, target, sent


def _propose(draft, request: ProposeRequest, hold: bool):
    inputs = {**wire.propose_inputs([request]), **wire.secret_input(boot_secret())}
    if hold:
        inputs.update(sample_hop.propose_hold_inputs([request]))
    (out,) = draft._propose([inputs])
    return out, sample_hop.mark_held(wire.proposals_of(out), out)[0]


def _verify(target, request: VerifyRequest):
    inputs = {**wire.verify_inputs([request]), **sample_hop.verify_sample_inputs([request]),
              **wire.secret_input(boot_secret())}  # fmt: skip
    (out,) = target._serve([inputs])
    results = wire.verify_results_of(out, [request.num_logits])
    return out, sample_hop.attach_sampled([request], results, out)[0]


def _by_hand(sampler, drafts, q, verified: VerifyResult, seed: int, position: int | None = None):
    out = sampler._sample(wire.sample_inputs([SampleCall(drafts, q, verified, seed, position=position)]))
    return wire.sample_results_of(out)[0]


@pytest.mark.parametrize("log_probs", [False, True])
def test_sampling_through_the_hop_equals_sampling_by_hand(served, log_probs):
    sampler, draft, target, sent = served
    sent.clear()
    hop, direct = f"hop-{log_probs}", f"direct-{log_probs}"
    # the prompt's step: no drafts; p goes to the sampler, the first token comes back
    prefill = dict(position=0, token_ids=PROMPT, num_logits=1, sampling=SAMPLED, log_probs=log_probs)
    _, first = _verify(target, VerifyRequest(hop, **prefill, sample_here=SampleHere(seed=21)))
    out, by_p = _verify(target, VerifyRequest(direct, **prefill))
    expected_first = _by_hand(sampler, torch.empty(0, dtype=torch.long), None, by_p, 21)
    assert first.probs is None and first.sampled.output_token_ids.tolist() == expected_first.output_token_ids.tolist()
    tokens = PROMPT + expected_first.output_token_ids.tolist()

    num_sent = 0  # tokens the proposer holds
    for step, seed in enumerate((31, 32, 33)):
        position = len(tokens) - 1
        propose = dict(position=num_sent, token_ids=tokens[num_sent:], num_tokens=K, sampling=SAMPLED,
                       seed=100 + step)  # fmt: skip
        num_sent = len(tokens)
        draft_out, held = _propose(draft, ProposeRequest(hop, **propose), hold=True)
        _, returned = _propose(draft, ProposeRequest(direct, **propose), hold=False)
        assert held.probs_held and held.probs is None and draft_out["draft_probs"].size == 0
        assert returned.probs is not None and held.token_ids.tolist() == returned.token_ids.tolist()
        assert len(sampler.held) == 1  # the hop's q waits in the sampler

        drafts = held.token_ids.tolist()
        verify = dict(position=position, token_ids=[tokens[-1], *drafts], num_logits=len(drafts) + 1,
                      sampling=SAMPLED, log_probs=log_probs)  # fmt: skip
        here = SampleHere(seed, True, position=len(tokens) - len(PROMPT))  # draws keyed by output position
        verify_out, judged = _verify(target, VerifyRequest(hop, **verify, sample_here=here))
        _, by_p = _verify(target, VerifyRequest(direct, **verify))
        expected = _by_hand(sampler, returned.token_ids, returned.probs, by_p, seed, here.position)
        assert verify_out["target_probs"].size == 0 and judged.probs is None  # p stayed behind
        assert judged.sampled.output_token_ids.tolist() == expected.output_token_ids.tolist()
        assert judged.sampled.num_accepted == expected.num_accepted
        if log_probs:
            want = emitted_log_probs(expected.output_token_ids.tolist(), by_p.log_mass, by_p.probs, by_p.argmax)
            assert judged.sampled.log_probs == pytest.approx(want)
        else:
            assert judged.sampled.log_probs is None
        assert len(sampler.held) == 0  # taken once sampled
        tokens += expected.output_token_ids.tolist()  # rejected drafts leave the caches at the next call
    release = {**wire.release_inputs([hop, direct]), **wire.secret_input(boot_secret())}
    draft._propose([release])
    target._serve([release])
    assert any("hold_draft_probs" in names for names in sent) and any("draft_probs_held" in n for n in sent)


def test_the_sampler_refuses_sequence_requests_without_the_secret_and_q_it_does_not_hold(served):
    sampler, *_ = served
    call = wire.sample_inputs([SampleCall(torch.tensor([4]), None, VerifyResult(torch.tensor([4, 5]),
                                                                                torch.full((2, 8), 1 / 8)), 3)])  # fmt: skip
    named = {**call, "seq_id": np.array([b"x"], np.object_), "draft_probs_held": np.array([True])}
    with pytest.raises(RequestError, match=SECRET_INPUT):
        sampler._sample(named)
    with pytest.raises(RequestError, match="'x': no draft distribution"):
        sampler._sample({**named, **wire.secret_input(boot_secret())})
    unflagged = {**named, "draft_probs_held": np.array([False]), **wire.secret_input(boot_secret())}
    assert wire.sample_results_of(sampler._sample(unflagged))[0].num_accepted in (0, 1)  # one-hot q at the draft
