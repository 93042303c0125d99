"""The head trainer's training windows: written text, and the target's own greedy continuations of it."""
from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from tiny_llama import build_tiny_llama, hf_generate_greedy  # noqa: E402
from train_draft_head import training_windows  # noqa: E402

SEQ_LEN = 14  # windows of SEQ_LEN + 2 = 16 tokens
PROMPT = 6


def windows_args(share: float, prompt: int = PROMPT) -> Namespace:
    return Namespace(seed=0, seq_len=SEQ_LEN, windows=10, generated_share=share, generated_prompt_tokens=prompt)


def occurs_in(row: torch.Tensor, data: torch.Tensor) -> bool:
    spans = data.unfold(0, len(row), 1)  # [len(data) - len(row) + 1, len(row)]
    return bool((spans == row).all(-1).any())


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(7))  # [3000]


def test_without_a_generated_share_every_window_is_text(text):
    windows = training_windows(build_tiny_llama(seed=0), text, windows_args(0.0))
    assert windows.shape == (10, SEQ_LEN + 2)
    assert all(occurs_in(row, text) for row in windows)


def test_a_generated_window_is_its_text_start_then_the_targets_greedy_continuation(text):
    target = build_tiny_llama(seed=0)
    plain = training_windows(target, text, windows_args(0.0))
    mixed = training_windows(target, text, windows_args(0.5))
    assert torch.equal(mixed[5:], plain[5:])  # the same seeded text windows, untouched
    assert torch.equal(mixed[:5, :PROMPT], plain[:5, :PROMPT])
    for row in mixed[:5]:
        expected = hf_generate_greedy(target, row[:PROMPT].tolist(), SEQ_LEN + 2 - PROMPT,
                                      min_new_tokens=SEQ_LEN + 2 - PROMPT)  # fmt: skip
        assert row[PROMPT:].tolist() == expected
    assert not all(occurs_in(row, text) for row in mixed[:5])  # the continuation is the target's, not the text's


@pytest.mark.parametrize("prompt", [0, SEQ_LEN + 2])
def test_a_prompt_that_leaves_no_room_is_refused_by_name(text, prompt):
    with pytest.raises(SystemExit, match="--generated-prompt-tokens"):
        training_windows(build_tiny_llama(seed=0), text, windows_args(0.5, prompt))
