"""Shared fixtures: tiny random Llama models built in-process, and the shipped model pair."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from specdec.models import load_causal_lm
from specdec.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = REPO_ROOT / "models" / "tiny-target"
SHIPPED_DRAFT = REPO_ROOT / "models" / "tiny-draft"

# Tiny models run faster on one thread than with two threads handing off work.
torch.set_num_threads(1)

from tiny_llama import build_tiny_llama, hf_generate_greedy  # noqa: E402,F401  (the fixtures build on them)


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
