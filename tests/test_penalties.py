"""Penalties, bad words and log probabilities of the target, checked against Hugging Face and a reference.

Hugging Face defines ``repetition_penalty`` (``RepetitionPenaltyLogitsProcessor``) and
bad words (``NoBadWordsLogitsProcessor``) but has no presence or frequency penalty, so
those are checked against :class:`OpenAIPenalties`, a direct transcription of OpenAI's
formula (``logit - frequency * count - presence * (count > 0)`` over the generated
tokens). Greedy speculative output with penalties must equal ``model.generate`` of the
target alone with the same processors, token for token.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers import NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor

from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.models import CachedCausalLM
from specdec.penalties import Penalties, apply_penalties
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import process_logits
from specdec.types import SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from test_greedy_equality import PROMPTS, text_to_ids

NUM_NEW_TOKENS = 24


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties as OpenAI documents them, over the tokens generated after the prompt."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float):
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token, count in Counter(ids[self.num_prompt_tokens :]).items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def reference_processors(penalties: Penalties, num_prompt_tokens: int) -> LogitsProcessorList:
    """Hugging Face's processors (and the OpenAI reference) for ``penalties``, in the order vLLM applies them."""
    processors = LogitsProcessorList()
    if penalties.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalties.repetition_penalty))
    if penalties.presence_penalty or penalties.frequency_penalty:
        processors.append(OpenAIPenalties(num_prompt_tokens, penalties.presence_penalty, penalties.frequency_penalty))
    if penalties.bad_words:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in penalties.bad_words]))
    return processors


def hf_greedy_with(model, prompt_ids: list[int], penalties: Penalties, max_new_tokens: int) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config,
                             logits_processor=reference_processors(penalties, len(prompt_ids)))  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def run(proposer, target, prompt_ids, params: GenerationParams) -> tuple[list[int], list[float]]:
    out, log_probs = [], []
    verifier = TargetVerifier(CachedCausalLM(target))
    for step in generate(proposer, verifier, RejectionSampler(), prompt_ids, params):
        out += step.new_token_ids
        log_probs += step.new_log_probs
    assert verifier._tokens == {}, "the verifier keeps no tokens of a released sequence"
    return out, log_probs


PENALTIES = {
    "repetition": Penalties(repetition_penalty=1.8),
    "repetition_below_one": Penalties(repetition_penalty=0.7),
    "presence_frequency": Penalties(presence_penalty=1.5, frequency_penalty=0.8),
    "bad_words": Penalties(bad_words=((7,), (40, 41), (1, 2, 3))),
    "all": Penalties(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, bad_words=((9,), (5, 6))),
}


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_rows_match_hf_processors_on_each_prefix(name):
    """Row j of a call is the reference processors applied to the sequence through that row's token."""
    penalties, generator = PENALTIES[name], torch.Generator().manual_seed(0)
    vocab, prompt_len, m = 64, 6, 5
    tokens = torch.randint(0, 12, (prompt_len + 9,), generator=generator).tolist()
    tokens[-4:-2] = [40, 41]  # a bad-word prefix ends inside the rows
    logits = torch.randn(m, vocab, generator=generator) * 3  # [m, vocab]
    ours = apply_penalties(logits, tokens, prompt_len, penalties)
    processors = reference_processors(penalties, prompt_len)
    for j in range(m):
        context = torch.tensor([tokens[: len(tokens) - m + 1 + j]])
        expected = processors(context, logits[j : j + 1].clone())[0]
        assert torch.allclose(ours[j], expected, atol=1e-5), f"row {j}"
    assert not torch.equal(ours, logits), "the penalties must change something here"


@pytest.mark.parametrize("method", ["draft_random", "draft_equal", "ngram"])
@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_output_equals_hf_generate_with_penalties(name, method, target_model, draft_model):
    penalties = PENALTIES[name]
    vocab = target_model.config.vocab_size
    proposer = {"draft_random": lambda: DraftModelProposer(CachedCausalLM(draft_model)),
                "draft_equal": lambda: DraftModelProposer(CachedCausalLM(target_model)),
                "ngram": lambda: NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)}[method]()  # fmt: skip
    changed = 0
    for prompt in PROMPTS[:8]:
        prompt_ids = text_to_ids(prompt, vocab)
        reference = hf_greedy_with(target_model, prompt_ids, penalties, NUM_NEW_TOKENS)
        params = GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=3, penalties=penalties)
        ours, _ = run(proposer, target_model, prompt_ids, params)
        assert ours == reference, f"prompt {prompt!r}"
        changed += reference != hf_greedy_with(target_model, prompt_ids, Penalties(), NUM_NEW_TOKENS)
    assert changed, "the penalties must change the greedy output of some prompt"


def test_shipped_pair_greedy_equals_hf_generate_with_penalties(shipped_pair):
    tokenizer, target = shipped_pair.tokenizer, shipped_pair.target
    bad = tuple(tuple(tokenizer.encode(word, add_special_tokens=False)) for word in (" the", " return"))
    penalties = Penalties(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, bad_words=bad)
    for prompt in ("Once upon a time", "def fibonacci(n):"):
        prompt_ids = tokenizer.encode(prompt)
        reference = hf_greedy_with(target, prompt_ids, penalties, 32)
        params = GenerationParams(max_tokens=32, num_speculative_tokens=4, penalties=penalties)
        ours, _ = run(DraftModelProposer(CachedCausalLM(shipped_pair.draft)), target, prompt_ids, params)
        assert ours == reference, prompt


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, seed=3),
                                      SamplingParams(temperature=1.3, top_p=0.8, seed=4)])  # fmt: skip
def test_log_probs_are_the_penalised_targets(sampling, target_model, draft_model):
    """Each emitted token's log probability equals log_softmax(penalised logits / T) at it, top-k/p aside."""
    penalties = PENALTIES["all"]
    prompt_ids = text_to_ids(PROMPTS[3], target_model.config.vocab_size)
    params = GenerationParams(max_tokens=20, num_speculative_tokens=3, sampling=sampling, penalties=penalties,
                              return_log_probs=True)  # fmt: skip
    verifier = TargetVerifier(CachedCausalLM(target_model))
    proposer = DraftModelProposer(CachedCausalLM(draft_model))
    steps = list(generate(proposer, verifier, RejectionSampler(), prompt_ids, params))
    out = [t for step in steps for t in step.new_token_ids]
    state_log_probs = [lp for step in steps for lp in step.new_log_probs]
    assert len(state_log_probs) == len(out) == 20
    processors = reference_processors(penalties, len(prompt_ids))
    temperature = 1.0 if sampling.greedy else sampling.temperature
    for i, token in enumerate(out):
        context = torch.tensor([prompt_ids + out[:i]])
        with torch.inference_mode():
            logits = target_model(context).logits[:, -1].float()  # [1, vocab]
        expected = torch.log_softmax(processors(context, logits)[0] / temperature, dim=-1)[token]
        assert state_log_probs[i] == pytest.approx(float(expected), abs=1e-4), f"token {i}"


def test_penalties_need_the_whole_sequence(target_model):
    verifier = TargetVerifier(CachedCausalLM(target_model))
    plain = VerifyRequest("s", 0, [1, 2, 3], 1, SamplingParams())
    verifier.verify([plain])
    with pytest.raises(ValueError, match="penalties need every token"):
        verifier.verify([VerifyRequest("s", 3, [4], 1, SamplingParams(), penalties=PENALTIES["repetition"])])


def test_bad_penalties_are_refused_naming_them():
    for penalties, name in ((Penalties(repetition_penalty=0.0), "repetition_penalty"),
                            (Penalties(frequency_penalty=float("inf")), "frequency_penalty"),
                            (Penalties(bad_words=((),)), "bad_words")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            GenerationParams(penalties=penalties).validate()


def test_process_logits_after_penalties_keeps_banned_words_out():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0
    penalised = apply_penalties(logits, [1, 2, 3], 1, Penalties(bad_words=((3,),)))
    probs = process_logits(penalised, SamplingParams(temperature=1.0))
    assert torch.all(probs[:, 3] == 0)
