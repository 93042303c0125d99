"""A draft model or head beside the target (specdec.draft_beside_target): one call per step, same output.

The scheduler drives real models here (a random Llama target, an EAGLE-3 head and a P-EAGLE one, an MLP
speculator and a draft model built in the test) through ``DraftBesideTarget``, as target_verifier runs it
when draft_proposer sets ``run_with_target``; greedy output must equal HF ``generate``
of the target alone, and seeded sampled output must equal the output of the same
models called as two stages.
"""
from __future__ import annotations

import asyncio
import collections
import functools

import pytest
import torch

from eagle3_heads import PROMPTS, random_head, random_peagle
from test_dflash import write_dflash
from test_medusa import write_medusa
from test_mlp_speculator import write_speculator
from test_mtp import random_mtp
from test_model_inputs import fake_pb_utils, load_model  # noqa: F401  (fake_pb_utils: the autouse fixture)
from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.draft_beside_target import DraftBesideTarget, HiddenRows, ProposeVerify, fit_to_drafts
from specdec.engine import GenerationParams, SequenceState
from specdec.heads import build_head_proposer, describe_head
from specdec.heads.formats import save_eagle3
from specdec.heads.mtp import write_into_target
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, ParallelDraftProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import StepCapabilities, StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.suffix_first import MODEL_SOURCE, SUFFIX_SOURCE, SuffixFirst, SuffixFirstConfig, SuffixFirstStages
from specdec.types import Proposal, SampleHere, SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from specdec_triton import sample_hop, wire
from specdec_triton.internal import boot_secret

VOCAB, DRAFT_VOCAB, K = 32, 24, 4
NUM_NEW_TOKENS = 20


def test_hidden_rows_are_kept_by_position_and_cut_back_where_a_verify_starts():
    rows = HiddenRows()
    rows.write("s", 0, torch.arange(5.0).reshape(5, 1))  # the prompt: positions 0..4
    assert rows.take("s", 0, 5).flatten().tolist() == [0, 1, 2, 3, 4]
    rows.write("s", 4, torch.tensor([[40.0], [50.0], [60.0]]))  # [last, d1, d2] from position 4
    assert rows.take("s", 5, 6).flatten().tolist() == [50]  # d1 accepted, d2 rejected: the next token is at 6
    assert rows.take("s", 5, 6).flatten().tolist() == [50]  # a call sent again gets the same rows
    rows.write("s", 6, torch.tensor([[70.0]]))  # d2's row is replaced
    assert rows.take("s", 6, 7).flatten().tolist() == [70]
    with pytest.raises(ValueError, match=r"positions 3 \.\. 6, and this process holds positions 6 \.\. 6"):
        rows.take("s", 3, 7)  # rows the head read already are gone
    assert rows.take("s", 7, 7) is None
    with pytest.raises(ValueError, match="from position 9, but rows are held only up to 7"):
        rows.write("s", 9, torch.zeros(1, 1))
    rows.release("s")
    assert len(rows) == 0
    with pytest.raises(ValueError, match="holds none"):
        rows.take("s", 0, 1)


def test_a_verify_request_built_for_k_drafts_is_cut_to_the_drafts_made():
    request = VerifyRequest("s", 10, [5, 0, 0, 0], 4, SamplingParams(temperature=0.7), num_banned_rows=4,
                            banned_token_ids=(0,), sample_here=SampleHere(seed=3))  # fmt: skip
    fitted = fit_to_drafts(request, Proposal(torch.tensor([8, 9]), probs_held=True))
    assert fitted.token_ids == [5, 8, 9] and fitted.num_logits == 3 and fitted.num_banned_rows == 3
    assert fitted.sample_here == SampleHere(seed=3, draft_probs_held=True) and fitted.position == 10
    assert fit_to_drafts(request, Proposal(torch.empty(0, dtype=torch.long))).token_ids == [5]
    with pytest.raises(ValueError, match="proposal has 4 tokens, more than the 3 requested"):
        fit_to_drafts(request, Proposal(torch.tensor([1, 2, 3, 4])))


class SeparateStages:
    """The models called as two stages, the hidden states through the caller; a local sampler."""

    capabilities = StepCapabilities()

    def __init__(self, proposer, verifier):
        self.proposer, self.verifier, self.sampler = proposer, verifier, RejectionSampler()

    async def propose(self, requests):
        return self.proposer.propose(requests)

    async def verify(self, requests):
        return self.verifier.verify(requests)

    async def sample(self, calls):
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, c.method, c.position) for c in calls]

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.proposer.release(seq_id, response)
            self.verifier.release(seq_id)


class BesideStages(SeparateStages):
    """The scheduler's stages over ``DraftBesideTarget``: the served target_verifier's calls, in-process.

    Without a judge, sampled sequences come back with ``q`` and ``p`` and go to the local
    sampler; with one (served: rejection_sampler's model), they are judged inside the call.
    """

    def __init__(self, beside: DraftBesideTarget):
        super().__init__(beside.proposer, beside.verifier)
        self.beside, self.calls = beside, []
        self.capabilities = StepCapabilities(samples_in_verify=beside.judge is not None, proposes_in_verify=True)

    async def propose_and_verify(self, steps: list[ProposeVerify]):
        await asyncio.sleep(0)
        self.calls.append(len(steps))
        return self.beside.step(steps)

    async def release(self, ended):
        for seq_id, response in ended.items():
            self.beside.release(seq_id, response)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 6-layer target with an MTP layer in its checkpoint, a two-layer EAGLE-3 head, a 4-stage MLP speculator,
    4 Medusa heads and a two-layer DFlash drafter of K drafts for it, a one-layer draft model."""
    root = tmp_path_factory.mktemp("beside")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, initializer_range=0.3)
    target.save_pretrained(root / "target")
    save_eagle3(random_head(root / "target", 5, DRAFT_VOCAB, num_layers=2), root / "head", verifier=str(root / "target"))
    save_eagle3(random_peagle(root / "target", 6, DRAFT_VOCAB, VOCAB - 1, num_layers=2), root / "peagle",
                verifier=str(root / "target"))  # fmt: skip
    write_speculator(root / "mlp", VOCAB, 32, n_predict=K, tie=False)
    write_medusa(root / "medusa", VOCAB, 32, num_heads=K)
    write_into_target(random_mtp(root / "target", 2), root / "target")
    write_dflash(root / "dflash", root / "target", block_size=K + 1, mask=VOCAB - 1, layer_ids=(1, 5))
    draft = build_tiny_llama(seed=1, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, initializer_range=0.3)
    return target, draft, root


def build(models, method):
    """(proposer, verifier, hidden layers the proposer reads), fresh caches each call."""
    target, draft, root = models
    verifier = TargetVerifier(CachedCausalLM(target))
    if method == "draft_model":
        return DraftModelProposer(CachedCausalLM(draft)), verifier, ()
    if method == "draft_model+parallel":  # PARD: every draft from one forward over mask tokens
        return ParallelDraftProposer(CachedCausalLM(draft), mask_token_id=3), verifier, ()
    if method == "eagle3+parallel":  # P-EAGLE: the same, an EAGLE-3 head over the target's hidden states
        proposer = build_head_proposer("eagle3", root / "peagle", root / "target", max_num_seqs=8, parallel_drafting=True)
        return proposer, verifier, describe_head(proposer, str(root / "peagle")).hidden_state_layers
    head = root / {"eagle3": "head", "mlp_speculator": "mlp", "medusa": "medusa", "mtp": "target", "dflash": "dflash"}[method]
    proposer = build_head_proposer(method, head, root / "target", max_num_seqs=8)
    return proposer, verifier, describe_head(proposer, str(head)).hidden_state_layers


def decode(stages, layers, params_of, rows_stay: bool, on_step=None,
           follows_acceptance=False) -> list[tuple[list[int], int]]:  # fmt: skip
    """Every prompt as one sequence, all in the same steps; each one's output tokens and drafts accepted."""
    speculation = SpeculationLength(K, follows_acceptance=follows_acceptance)
    scheduler = StepScheduler(stages, speculation, max_num_seqs=None, on_step=on_step)
    states = [SequenceState(f"s{i}", prompt, params_of(i), layers, hidden_rows_stay=rows_stay)
              for i, prompt in enumerate(PROMPTS)]  # fmt: skip

    async def collect(sequence):
        return [step async for step in sequence.steps()]

    async def main():
        return await asyncio.gather(*(collect(scheduler.submit(state)) for state in states))

    asyncio.run(main())
    return [(list(state.output_ids), state.stats.num_accepted_tokens) for state in states]


@pytest.mark.parametrize("method", ["eagle3", "eagle3+parallel", "draft_model", "draft_model+parallel", "mlp_speculator",
                                    "medusa", "mtp", "dflash"])  # fmt: skip
@pytest.mark.parametrize("k", [1, 3, K])
def test_greedy_output_equals_hf_generate_with_the_proposer_beside_the_target(models, method, k):
    def params(i):
        return GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=k)

    proposer, verifier, layers = build(models, method)
    separate = decode(SeparateStages(proposer, verifier), layers, params, rows_stay=False)
    proposer, verifier, layers = build(models, method)
    stages = BesideStages(DraftBesideTarget(verifier, proposer, layers))
    outputs = decode(stages, layers, params, rows_stay=True)
    for prompt, (output, _) in zip(PROMPTS, outputs):
        assert output == hf_generate_greedy(models[0], prompt, NUM_NEW_TOKENS), (method, k, prompt)
    # the same drafts as with the hidden states through the caller: every sequence accepted as many
    assert outputs == separate and sum(accepted for _, accepted in outputs) > 0
    assert len(stages.calls) < NUM_NEW_TOKENS + 1  # one call a step
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0
    assert len(stages.beside.rows) == 0 and stages.beside.num_active_sequences == 0


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_a_k_that_follows_acceptance_beside_the_target_keeps_the_targets_output(models, method):
    """Each sequence asks its own k of the one call a step makes; output is the target's whatever they are."""
    proposer, verifier, layers = build(models, method)
    stages = BesideStages(DraftBesideTarget(verifier, proposer, layers))
    outputs = decode(stages, layers, lambda i: GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=K),
                     rows_stay=True, follows_acceptance=True)  # fmt: skip
    for prompt, (output, _) in zip(PROMPTS, outputs):
        assert output == hf_generate_greedy(models[0], prompt, NUM_NEW_TOKENS), (method, prompt)
    assert verifier.num_active_sequences == 0 and len(stages.beside.rows) == 0


@pytest.mark.parametrize("method", ["eagle3", "eagle3+parallel", "draft_model", "draft_model+parallel", "mlp_speculator",
                                    "mtp", "dflash"])  # fmt: skip
def test_sampled_output_equals_the_two_stage_output_seed_for_seed(models, method):
    def params(i):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)
        return GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=K, sampling=sampling)

    proposer, verifier, layers = build(models, method)
    separate = decode(SeparateStages(proposer, verifier), layers, params, rows_stay=False)
    proposer, verifier, layers = build(models, method)
    beside = decode(BesideStages(DraftBesideTarget(verifier, proposer, layers)), layers, params, rows_stay=True)
    assert beside == separate
    assert len({tuple(o) for o, _ in beside}) == len(PROMPTS)


@pytest.fixture(scope="module")
def sampler_model():
    """rejection_sampler's model.py, loaded here: sampled sequences are judged as target_verifier has them judged."""
    return load_model("rejection_sampler")


def test_sampled_sequences_are_judged_with_q_and_p_in_one_sampler_request(models, sampler_model):
    sent = []

    def send(inputs):
        sent.append(("hold" if sample_hop.is_hold(inputs) else "judge", "draft_probs" in inputs))
        return sampler_model._sample({**inputs, **wire.secret_input(boot_secret())})

    def params(i):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=200 + i)
        return GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=K, sampling=sampling)

    proposer, verifier, layers = build(models, "eagle3")
    separate = decode(SeparateStages(proposer, verifier), layers, params, rows_stay=False)
    proposer, verifier, layers = build(models, "eagle3")
    judge = functools.partial(sample_hop.sample_in_sampler, send=send)
    assert decode(BesideStages(DraftBesideTarget(verifier, proposer, layers, judge)), layers, params, True) == separate
    # one request a step, q in it (a prefill or a last step drafts nothing); none held first
    assert {kind for kind, _ in sent} == {"judge"} and any(with_q for _, with_q in sent)
    assert len(sampler_model.held) == 0


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_suffix_decoding_in_front_of_the_proposer_beside_the_target(models, method):
    """Steps suffix decoding drafts send their drafts in the verify request; the model catches up when called."""
    config = SuffixFirstConfig(min_score=1.0)

    def params(i):
        return GenerationParams(max_tokens=2 * NUM_NEW_TOKENS, num_speculative_tokens=K)

    def run(beside: bool):
        sources = collections.Counter()

        def count(report):
            sources.update(step.source for step in report.sequences if step.num_draft_tokens)

        proposer, verifier, layers = build(models, method)
        read = collections.defaultdict(list)  # seq_id -> (hidden_position, rows) of each model request
        propose = proposer.propose

        def recording(requests):
            for r in requests:
                read[r.seq_id].append((r.hidden_position, 0 if r.hidden_states is None else r.hidden_states.shape[0]))
            return propose(requests)

        proposer.propose = recording
        inner = BesideStages(DraftBesideTarget(verifier, proposer, layers)) if beside else SeparateStages(proposer, verifier)
        outputs = decode(SuffixFirstStages(inner, SuffixFirst(config, rows_stay=beside)), layers, params, beside, count)
        assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0
        if layers:  # the head reads each row once: every request starts where the one before stopped
            for calls in read.values():
                assert all(p + n == next_p for (p, n), (next_p, _) in zip(calls, calls[1:])), calls
        return outputs, sources

    separate, separate_sources = run(beside=False)
    beside, sources = run(beside=True)
    for prompt, (output, _) in zip(PROMPTS, beside):
        assert output == hf_generate_greedy(models[0], prompt, 2 * NUM_NEW_TOKENS), (method, prompt)
    # the same drafts from either source as with the hidden states through the caller
    assert beside == separate and sources == separate_sources
    assert sources[SUFFIX_SOURCE] > 0 and sources[MODEL_SOURCE] > 0, sources


def test_a_propose_request_carrying_hidden_states_is_refused(models):
    proposer, verifier, layers = build(models, "eagle3")
    beside = DraftBesideTarget(verifier, proposer, layers)
    state = SequenceState("s", [1, 2, 3], GenerationParams(max_tokens=8, num_speculative_tokens=2), layers)
    request = state.verify_request(None)
    result = verifier.verify([request])[0]
    state.commit(None, RejectionSampler()(torch.empty(0, dtype=torch.long), None, result, 0), result)
    propose = state.propose_request()  # rows travel: the state sends them
    with pytest.raises(ValueError, match="the target beside the head keeps them"):
        beside.step([ProposeVerify(propose, state.verify_request(Proposal(torch.zeros(2, dtype=torch.long))))])
