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


def head_args(init_from: Path, num_layers: int) -> Namespace:
    return Namespace(draft_vocab_size=48, aux_layers=None, hidden_size=32, intermediate_size=0,
                     num_layers=num_layers, init_from=str(init_from))  # fmt: skip


def small_llama(seed: int, heads: int, kv_heads: int, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_deeper_heads_later_layers_start_from_the_init_models_own(text, tmp_path):
    """``--num-layers 3 --init-from`` a 2-layer LM of the head's shape: layer 1 is the LM's layer 1, layer 2 stays random."""
    from specdec.fast.checkpoint import read_config
    from train_draft_head import build_eagle3

    target = build_tiny_llama(seed=0, hidden_size=64, num_hidden_layers=6)  # head_dim 16: a 32-wide head has 2 heads
    target.save_pretrained(tmp_path / "target")
    source = small_llama(1, heads=2, kv_heads=1)
    source.save_pretrained(tmp_path / "source")
    head = build_eagle3(target, read_config(tmp_path / "target"), head_args(tmp_path / "source", 3), text)
    layer, src = head.layers[1], source.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, src.self_attn.q_proj.weight) and torch.equal(v, src.self_attn.v_proj.weight)
    assert torch.equal(layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(head.embed_tokens.weight, source.model.embed_tokens.weight)
    assert not torch.equal(head.layers[2].mlp.down_proj.weight, src.mlp.down_proj.weight)
    small_llama(2, heads=4, kv_heads=2).save_pretrained(tmp_path / "other")  # head_dim 8: not the head's shape
    with pytest.raises(SystemExit, match=r"its layers have \(heads, kv heads, head_dim, intermediate\) \(4, 2, 8, 64\), "
                                         r"the head's \(2, 1, 16, 64\)"):  # fmt: skip
        build_eagle3(target, read_config(tmp_path / "target"), head_args(tmp_path / "other", 2), text)
