"""Sampling with penalties and bad words stays lossless: a chi-square test of the whole engine.

As in ``test_sampled_losslessness``: the exact joint distribution of the first three
tokens under target-only sampling is enumerated, here with every penalty and a bad word
applied by the reference processors (Hugging Face's and the OpenAI reference in
``test_penalties``). Speculative generation with a draft whose ``q`` knows nothing of
the penalties must reproduce it, since the verifier penalises ``p`` row by row. The same
samples must fail against the unpenalised joint, which shows the penalties matter here.
"""
from __future__ import annotations

import pytest
import torch

from specdec.engine import GenerationParams
from specdec.penalties import Penalties
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import process_logits
from test_penalties import reference_processors
from test_sampled_losslessness import (
    NUM_TOKENS, PROMPT, SAMPLING, CountingSampler, chisquare_pvalue, models, sample_first_tokens,
)  # fmt: skip

__all__ = ["models"]  # the fixture, shared with test_sampled_losslessness
NUM_SAMPLES = 2000
PENALTIES = Penalties(repetition_penalty=2.0, presence_penalty=0.7, frequency_penalty=0.5, bad_words=((5,), (3, 9)))

pytestmark = pytest.mark.slow


def exact_joint(target, penalties: Penalties) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS outputs) under target-only sampling with ``penalties``, by enumeration."""
    processors = reference_processors(penalties, len(PROMPT))
    joint = {(): 1.0}
    for _ in range(NUM_TOKENS):
        extended = {}
        for prefix, mass in joint.items():
            context = torch.tensor([PROMPT + list(prefix)])
            with torch.inference_mode():
                logits = target(context).logits[:, -1].float()  # [1, vocab]
            p = process_logits(processors(context, logits), SAMPLING)[0]  # [vocab]
            for token in torch.nonzero(p).flatten().tolist():
                extended[prefix + (token,)] = mass * float(p[token])
        joint = extended
    return joint


@pytest.mark.parametrize("method", ["probabilistic", "strict"])
def test_penalised_sampling_matches_the_penalised_target(models, method):
    target, draft = models
    joint = exact_joint(target, PENALTIES)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    assert all(5 not in outcome for outcome in joint), "the bad word has probability 0"
    sampler = CountingSampler(RejectionSampler(method))
    params = GenerationParams(penalties=PENALTIES)
    counts = sample_first_tokens(target, draft, sampler, NUM_SAMPLES, params)
    assert 0.05 < sampler.accepted / sampler.drafted < 0.95, "both accepted and rejected drafts must occur"
    assert chisquare_pvalue(counts, joint) > 1e-3
    assert chisquare_pvalue(counts, exact_joint(target, Penalties())) < 1e-6, "the penalties must matter"
