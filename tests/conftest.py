"""Shared fixtures: tiny random Llama models built in-process, and the shipped model pair."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specdec.models import load_causal_lm, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = REPO_ROOT / "models" / "tiny-target"
SHIPPED_DRAFT = REPO_ROOT / "models" / "tiny-draft"

# Tiny models run faster on one thread than with two threads handing off work.
torch.set_num_threads(1)


def build_tiny_llama(
    seed: int,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    initializer_range: float = 0.1,
    max_position_embeddings: int = 1024,
) -> PreTrainedModel:
    """A random Llama; a larger ``initializer_range`` than HF's 0.02 keeps logits from being near-uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def hf_generate_greedy(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    min_new_tokens: int = 0,
) -> list[int]:
    """The reference: Hugging Face's own greedy decoding, from a fresh generation config."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    return hf_generate_greedy


@pytest.fixture(scope="session")
def tiny_llama():
    """The builder, for tests that need a model of their own shape."""
    return build_tiny_llama


@pytest.fixture(scope="session")
def target_model() -> PreTrainedModel:
    return build_tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft_model() -> PreTrainedModel:
    """Same shape and vocabulary as ``target_model``, independent weights: acceptance is low."""
    return build_tiny_llama(seed=1, num_hidden_layers=1)


@dataclass(frozen=True)
class ShippedPair:
    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: object


@pytest.fixture(scope="session")
def shipped_pair() -> ShippedPair:
    if not (SHIPPED_TARGET.is_dir() and SHIPPED_DRAFT.is_dir()):
        pytest.skip(f"shipped model pair not found under {REPO_ROOT / 'models'}")
    return ShippedPair(
        target=load_causal_lm(SHIPPED_TARGET, dtype="float32"),
        draft=load_causal_lm(SHIPPED_DRAFT, dtype="float32"),
        tokenizer=load_tokenizer(SHIPPED_TARGET),
    )
