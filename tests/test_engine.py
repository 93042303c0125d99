"""The decode loop and its state machine: budgets, stops, min_tokens, seeds, stats, release."""
from __future__ import annotations

import pytest
import torch

from specdec.engine import GenerationParams, SequenceState, StepOutput
from specdec.generate import generate
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.proposers.base import Proposer
from specdec.rejection_sampler import RejectionSampler
from specdec.types import Proposal, SampleResult, SamplingParams
from specdec.verifier import TargetVerifier

PROMPT = list(b"def add(a, b):\n    return")
SAMPLED = SamplingParams(temperature=1.0, top_k=8)


class Recording(Proposer):
    """Wraps a proposer or sampler and keeps what passed through it."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def propose(self, requests):
        self.calls.extend(requests)
        return self.inner.propose(requests)

    def release(self, seq_id, response=None):
        self.inner.release(seq_id, response)

    def __call__(self, *args, **kwargs):
        result = self.inner(*args, **kwargs)
        self.calls.append(result)
        return result


def run(proposer, verifier, prompt, params, sampler=None) -> tuple[list[int], list[StepOutput]]:
    steps = list(generate(proposer, verifier, sampler or RejectionSampler(), prompt, params))
    return [t for s in steps for t in s.new_token_ids], steps


def test_k0_is_plain_autoregressive_decoding(target_model, hf_greedy):
    proposer = Recording(NgramProposer(1, 1))
    out, steps = run(proposer, TargetVerifier(CachedCausalLM(target_model)), PROMPT, GenerationParams(max_tokens=12))
    assert out == hf_greedy(target_model, PROMPT, 12)
    assert proposer.calls == [] and all(len(s.new_token_ids) == 1 for s in steps)
    assert steps[-1].stats.num_steps == 11 and steps[-1].stats.num_draft_tokens == 0
    out_without_proposer, _ = run(None, TargetVerifier(CachedCausalLM(target_model)), PROMPT, GenerationParams(max_tokens=12))
    assert out_without_proposer == out


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 12])
def test_k_larger_than_the_remaining_budget_never_overshoots(target_model, hf_greedy, max_tokens):
    proposer = Recording(DraftModelProposer(CachedCausalLM(target_model)))  # draft == target: every draft is accepted
    params = GenerationParams(max_tokens=max_tokens, num_speculative_tokens=10)
    out, steps = run(proposer, TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert out == hf_greedy(target_model, PROMPT, max_tokens)
    assert steps[-1].finish_reason == "length"
    for request in proposer.calls:
        left = max_tokens - (request.position + len(request.token_ids) - len(PROMPT))
        assert 1 <= request.num_tokens <= left - 1
    # Every draft is accepted, so one speculative step fills whatever budget the prefill left.
    assert len(proposer.calls) == (1 if max_tokens > 2 else 0)


def test_empty_proposals_still_emit_one_token_per_step(target_model, hf_greedy):
    proposer = Recording(NgramProposer(prompt_lookup_min=50))  # never matches
    params = GenerationParams(max_tokens=10, num_speculative_tokens=3)
    out, steps = run(proposer, TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert out == hf_greedy(target_model, PROMPT, 10)
    assert len(proposer.calls) == 8  # the last step has room for no draft
    stats = steps[-1].stats
    assert (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (9, 0, 0)


def _eos_inside_a_block(reference: list[int], k: int) -> int | None:
    """Index of a token that first occurs at a draft slot after the first (not the bonus) of a fully
    accepted block: accepted drafts precede it and the sampler returns tokens after it."""
    for j in range(2, len(reference)):
        if 0 < (j - 1) % (k + 1) < k and reference[j] not in reference[:j]:
            return j
    return None


def test_nothing_after_an_eos_inside_accepted_drafts(target_model, hf_greedy):
    k = 5
    reference = hf_greedy(target_model, PROMPT, 30)
    j = _eos_inside_a_block(reference, k)
    assert j is not None, f"no usable EOS position in {reference}"
    eos = reference[j]
    sampler = Recording(RejectionSampler())
    params = GenerationParams(max_tokens=30, num_speculative_tokens=k, eos_token_ids=(eos,))
    out, steps = run(DraftModelProposer(CachedCausalLM(target_model)), TargetVerifier(CachedCausalLM(target_model)), PROMPT, params, sampler)
    assert out == reference[: j + 1]
    assert steps[-1].finish_reason == "stop" and steps[-1].new_token_ids[-1] == eos
    last_result = sampler.calls[-1].output_token_ids.tolist()
    assert len(last_result) > len(steps[-1].new_token_ids), "the sampler returned tokens past EOS"
    assert hf_greedy(target_model, PROMPT, 30, eos_token_id=eos) == out


def _first_new_bigram(reference: list[int], start: int) -> int | None:
    """Index j >= start where the bigram reference[j : j + 2] first occurs."""
    bigrams = [tuple(reference[i : i + 2]) for i in range(len(reference) - 1)]
    return next((j for j in range(start, len(bigrams)) if bigrams[j] not in bigrams[:j]), None)


def test_stop_sequences_end_the_output_and_are_included(target_model, hf_greedy):
    reference = hf_greedy(target_model, PROMPT, 30)
    j = _first_new_bigram(reference, start=3)
    assert j is not None, f"no usable stop sequence in {reference}"
    stop = tuple(reference[j : j + 2])
    never = next(t for t in range(target_model.config.vocab_size) if t not in reference)
    params = GenerationParams(max_tokens=30, num_speculative_tokens=4, stop_token_sequences=((never,), stop))
    out, steps = run(DraftModelProposer(CachedCausalLM(target_model)), TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert out == reference[: j + 2]
    assert steps[-1].finished and steps[-1].finish_reason == "stop"


@pytest.mark.parametrize("draft", ["none", "equal", "random"])
def test_min_tokens_bans_eos_like_hf_min_new_tokens(target_model, draft_model, hf_greedy, draft):
    eos = hf_greedy(target_model, PROMPT, 1)[0]  # the target's first greedy token
    proposer = {"none": None, "equal": DraftModelProposer(CachedCausalLM(target_model)), "random": DraftModelProposer(CachedCausalLM(draft_model))}
    params = GenerationParams(
        max_tokens=20, min_tokens=4, num_speculative_tokens=0 if draft == "none" else 3, eos_token_ids=(eos,)
    )
    out, _ = run(proposer[draft], TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert eos not in out[:4]
    assert out == hf_greedy(target_model, PROMPT, 20, eos_token_id=eos, min_new_tokens=4)


def test_min_tokens_holds_back_stop_sequences(target_model, hf_greedy):
    reference = hf_greedy(target_model, PROMPT, 12)
    stop = tuple(reference[0:2])  # would stop at once without min_tokens
    params = GenerationParams(max_tokens=12, min_tokens=5, stop_token_sequences=(stop,))
    out, _ = run(None, TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert len(out) >= 6 and out[:2] == list(stop)


def test_seeded_sampling_is_reproducible(target_model, draft_model):
    def sample(seed):
        params = GenerationParams(max_tokens=16, num_speculative_tokens=3, sampling=SamplingParams(1.0, 8, 1.0, seed))
        out, steps = run(DraftModelProposer(CachedCausalLM(draft_model)), TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
        return out, [len(s.new_token_ids) for s in steps]

    assert sample(42) == sample(42)
    assert len({tuple(sample(seed)[0]) for seed in range(4)}) > 1


def test_stats_count_steps_drafts_and_accepted_positions(target_model):
    params = GenerationParams(max_tokens=13, num_speculative_tokens=3)
    _, steps = run(DraftModelProposer(CachedCausalLM(target_model)), TargetVerifier(CachedCausalLM(target_model)), PROMPT, params)
    assert all(s.stats is None for s in steps[:-1])
    stats = steps[-1].stats
    assert (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 9)
    assert stats.accepted_per_position == [3, 3, 3]
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 4.0


def test_release_on_finish_early_close_and_errors(target_model, draft_model):
    verifier, proposer = TargetVerifier(CachedCausalLM(target_model)), DraftModelProposer(CachedCausalLM(draft_model))
    params = GenerationParams(max_tokens=8, num_speculative_tokens=2)
    steps = generate(proposer, verifier, RejectionSampler(), PROMPT, params, seq_id="x")
    next(steps)
    next(steps)
    assert verifier.num_active_sequences == 1 and proposer.num_active_sequences == 1
    steps.close()
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0

    run(proposer, verifier, PROMPT, params)
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0

    def failing_sampler(draft_ids, draft_probs, verify, seed, position=None):
        if len(draft_ids):
            raise RuntimeError("sampler failed")
        return RejectionSampler()(draft_ids, draft_probs, verify, seed)

    with pytest.raises(RuntimeError, match="sampler failed"):
        run(proposer, verifier, PROMPT, params, failing_sampler)
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0


def test_a_failing_proposer_still_releases_the_verifier(target_model):
    class Broken(Proposer):
        released = []

        def propose(self, requests):
            raise RuntimeError("proposer failed")

        def release(self, seq_id, response=None):
            self.released.append(seq_id)

    verifier, proposer = TargetVerifier(CachedCausalLM(target_model)), Broken()
    with pytest.raises(RuntimeError, match="proposer failed"):
        run(proposer, verifier, PROMPT, GenerationParams(max_tokens=4, num_speculative_tokens=2))
    assert verifier.num_active_sequences == 0 and len(proposer.released) == 1


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (GenerationParams(max_tokens=0), "max_tokens"),
        (GenerationParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (GenerationParams(min_tokens=-1), "min_tokens"),
        (GenerationParams(num_speculative_tokens=-1), "num_speculative_tokens"),
        (GenerationParams(sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (GenerationParams(eos_token_ids=(-2,)), "eos_token_ids"),
        (GenerationParams(stop_token_sequences=((),)), "stop_token_sequences"),
    ],
)
def test_invalid_params_name_the_field(params, named):
    with pytest.raises(ValueError, match=named):
        params.validate()


def test_prompt_plus_max_tokens_must_fit_the_model(target_model):
    GenerationParams(max_tokens=4).validate(max_model_len=10, prompt_len=6)
    with pytest.raises(ValueError, match="max_model_len=10"):
        GenerationParams(max_tokens=5).validate(max_model_len=10, prompt_len=6)
    verifier = TargetVerifier(CachedCausalLM(target_model, max_model_len=len(PROMPT) + 3))
    with pytest.raises(ValueError, match="max_tokens"):
        next(generate(None, verifier, RejectionSampler(), PROMPT, GenerationParams(max_tokens=4)))


@pytest.mark.parametrize(
    ("prompt", "params", "named"),
    [
        ([1, 256], GenerationParams(), "prompt_ids"),
        ([1, 2], GenerationParams(eos_token_ids=(300,)), "eos_token_ids"),
        ([1, 2], GenerationParams(stop_token_sequences=((1, 999),)), "stop_token_sequences"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_rejected(target_model, prompt, params, named):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    with pytest.raises(ValueError, match=f"{named} must lie in \\[0, 256\\)"):
        next(generate(None, verifier, RejectionSampler(), prompt, params))
    assert verifier.num_active_sequences == 0


def test_speculation_requires_a_proposer(target_model):
    with pytest.raises(ValueError, match="proposer"):
        next(generate(None, TargetVerifier(CachedCausalLM(target_model)), RejectionSampler(), PROMPT,
                      GenerationParams(num_speculative_tokens=2)))


# SequenceState alone, driven by scripted sampler results: no model runs.


def result(tokens: list[int], num_accepted: int) -> SampleResult:
    return SampleResult(output_token_ids=torch.tensor(tokens), num_accepted=num_accepted)


def proposal(tokens: list[int]) -> Proposal:
    return Proposal(token_ids=torch.tensor(tokens, dtype=torch.long))


def test_state_machine_positions_and_token_flow():
    state = SequenceState("s", [10, 11, 12], GenerationParams(max_tokens=8, num_speculative_tokens=3))
    assert state.propose_request() is None  # the prefill drafts nothing
    prefill = state.verify_request(None)
    assert (prefill.position, prefill.token_ids, prefill.num_logits) == (0, [10, 11, 12], 1)
    assert state.commit(None, result([20], 0)).new_token_ids == [20]

    request = state.propose_request()
    assert (request.position, request.token_ids, request.num_tokens) == (0, [10, 11, 12, 20], 3)
    assert request.seed != state.sample_seed()  # draft and sampler draw from independent streams
    drafts = proposal([21, 22, 23])
    verify = state.verify_request(drafts)
    assert (verify.position, verify.token_ids, verify.num_logits) == (3, [20, 21, 22, 23], 4)
    step = state.commit(drafts, result([21, 30], 1))  # one accepted, then a recovered token
    assert step.new_token_ids == [21, 30] and not step.finished

    # Drafts past position 5 were rejected: the next verify starts at the last emitted token.
    request = state.propose_request()
    assert request.num_tokens == 3  # 5 of 8 left -> min(3, 5 - 1)
    assert (request.position, request.token_ids) == (4, [21, 30])  # only what the proposer was not sent
    verify = state.verify_request(proposal([31]))
    assert (verify.position, verify.token_ids, verify.num_logits) == (5, [30, 31], 2)
    assert state.stats.accepted_per_position == [1, 0, 0]


def test_state_machine_rejects_inconsistent_inputs():
    state = SequenceState("s", [1], GenerationParams(max_tokens=3, num_speculative_tokens=4))
    with pytest.raises(ValueError, match="proposal has 1 tokens"):
        state.verify_request(proposal([5]))  # the prefill takes no drafts
    state.commit(None, result([2], 0))
    assert state.propose_request().num_tokens == 1  # 2 tokens left
    with pytest.raises(ValueError, match="num_accepted"):
        state.commit(proposal([3]), result([3, 4, 5], 2))
    step = state.commit(proposal([3]), result([3, 4], 1))
    assert step.finished and step.finish_reason == "length" and state.output_ids == [2, 3, 4]
    with pytest.raises(RuntimeError, match="already finished"):
        state.propose_request()
    with pytest.raises(ValueError, match="prompt_ids"):
        SequenceState("s", [], GenerationParams())


def test_state_machine_seeds_and_min_tokens_bans():
    params = GenerationParams(
        max_tokens=6, min_tokens=2, eos_token_ids=(0,), stop_token_sequences=((9,), (7, 8)),
        sampling=SamplingParams(temperature=1.0, seed=5),
    )
    a, b = SequenceState("a", [1], params), SequenceState("b", [1], params)
    assert a.sample_seed() == b.sample_seed()
    request = a.verify_request(None)
    assert request.num_banned_rows == 1 and request.banned_token_ids == (0, 9)  # single-token stops too
    c = SequenceState("c", [1], GenerationParams(max_tokens=8, min_tokens=4, eos_token_ids=(0,),
                                                 num_speculative_tokens=4))
    c.commit(None, result([7], 0))  # the prefill step drafts nothing
    propose = c.propose_request()
    assert propose.num_banned_tokens == 3 and propose.banned_token_ids == (0,)  # drafts below min_tokens
    a.commit(None, result([7], 0))
    assert a.sample_seed() == b.sample_seed() and (a.sample_position(), b.sample_position()) == (1, 0)  # draws by position
    assert a.verify_request(None).num_banned_rows == 1
    a.commit(None, result([8], 0))  # (7, 8) completes at index 1 < min_tokens: no stop
    assert not a.finished and a.verify_request(None).num_banned_rows == 0
    assert a.commit(None, result([0], 0)).finish_reason == "stop"


def test_a_step_that_drafts_nothing_leaves_its_tokens_to_the_next_request():
    """k = 0 sends nothing, so the next propose request starts where the last one ended."""
    state = SequenceState("s", [10, 11], GenerationParams(max_tokens=8, num_speculative_tokens=2))
    state.commit(None, result([20], 0))  # the prefill
    first = state.propose_request()
    assert (first.position, first.token_ids) == (0, [10, 11, 20])
    state.commit(proposal([21, 22]), result([21, 22, 23], 2))
    assert state.propose_request(max_drafts=0) is None  # a length policy's k = 0: nothing is sent
    state.commit(None, result([24], 0))
    request = state.propose_request()
    assert (request.position, request.token_ids) == (3, [21, 22, 23, 24])


def test_propose_requests_carry_exactly_the_tokens_not_sent_across_the_prompt_boundary():
    state = SequenceState("s", [10, 11, 12], GenerationParams(max_tokens=8, num_speculative_tokens=2))
    state._num_sent_to_proposer = 2  # a proposer that holds part of the prompt only
    state.commit(None, result([20], 0))
    assert state.propose_request().token_ids == [12, 20]
    state.commit(None, result([21], 0))
    assert state.propose_request().token_ids == [21]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_seeded_sampling_with_lookup_drafts_emits_the_targets_own_draws(target_model, k):
    """Draws keyed by output position, and a one-hot q judged as strict: what was drafted does not change the text."""
    prompt = list(b"ab ab ab ab ab ab ab ab ab ab ab ab")  # the n-gram lookup finds continuations
    sampling = SamplingParams(temperature=0.5, top_k=3, seed=11)  # concentrated: the target repeats, drafts land
    verifier = TargetVerifier(CachedCausalLM(target_model))
    plain, _ = run(None, verifier, prompt, GenerationParams(max_tokens=24, sampling=sampling))
    proposer = Recording(NgramProposer(1, 2))
    drafted, steps = run(proposer, verifier, prompt,
                         GenerationParams(max_tokens=24, num_speculative_tokens=k, sampling=sampling))  # fmt: skip
    assert steps[-1].stats.num_draft_tokens > 0 and drafted == plain
    assert steps[-1].stats.num_accepted_tokens > 0 and len(steps) < len(plain)  # fewer steps than tokens
