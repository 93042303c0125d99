"""The Triton slot-attention kernel agrees with the torch (gather + SDPA) path.

On CPU the kernel runs under ``TRITON_INTERPRET=1``, set in a subprocess so that no
other test sees the interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specdec.fast import FastCausalLM
from specdec.fast.llama import default_triton_attention
from test_fast_llama import save_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]

KERNEL_VS_TORCH = textwrap.dedent(
    """
    import sys
    import torch
    from specdec.fast.attention_kernel import slot_attention
    from specdec.fast.llama import BatchIndex, torch_slot_attention

    path, device = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    num_slots, kv_heads, heads, max_len, head_dim = 4, 2, 6, 80, 24  # GQA group 3; head_dim not a power of 2
    kv = torch.randn(2, num_slots, kv_heads, max_len, head_dim, device=device)  # [2, slots, KVH, L, D]
    starts = torch.tensor([0, 37, 75, 0], device=device)  # the third row runs past max_len: padding is clamped
    num_new = torch.tensor([3, 1, 5, 0], device=device)  # the last row is unused
    slots = torch.tensor([2, 0, 1, 3], device=device)
    batch = BatchIndex(starts, num_new, slots, 5, max_len, num_slots - 1, max_len)
    q = torch.randn(4, 5, heads, head_dim, device=device).transpose(1, 2)  # [B, H, S, D], D contiguous
    got = slot_attention(q, kv[0], kv[1], slots, batch.write_pos, head_dim**-0.5)
    want = torch_slot_attention(q, kv, batch, head_dim**-0.5, grouped=True)
    real = torch.arange(5, device=device)[None, :] < num_new[:, None]  # [B, S]: padded rows are garbage
    torch.testing.assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    print("kernel ok")
    """
)

COUNT_KERNEL_CALLS = textwrap.dedent(
    """
    import specdec.fast.attention_kernel as attention_kernel

    kernel_calls = []

    def counted(*args, _kernel=attention_kernel.slot_attention):
        kernel_calls.append(args[0].shape)  # [B, H, S, D]
        return _kernel(*args)

    attention_kernel.slot_attention = counted  # what Attention and use_triton_attention import from now on
    """
)

MODEL_WITH_KERNEL = COUNT_KERNEL_CALLS + textwrap.dedent(
    """
    import sys
    import torch
    from specdec.fast import FastCausalLM, ForwardCall
    from specdec.fast.cuda_graphs import StaticShapeRunner

    calls = [
        [ForwardCall("a", 0, list(range(1, 40)), 2), ForwardCall("b", 0, [7, 8, 9], 1)],  # eager: SDPA
        [ForwardCall("a", 38, [5, 6, 7], 3), ForwardCall("b", 3, [1], 1)],  # fixed shape: the kernel
        [ForwardCall("a", 41, [2], 1), ForwardCall("b", 4, [3, 4], 2)],
    ]
    kernel_lm = FastCausalLM(path, "float32", device, 2, 64, device == "cuda", triton_attention=True)
    torch_lm = FastCausalLM(path, "float32", device, 2, 64, False, triton_attention=False)
    if device == "cpu":  # the passes a graph would replay, uncaptured
        kernel_lm.graphs = StaticShapeRunner(kernel_lm.model, kernel_lm.cache, (1, 2, 4, 8))
    for step in calls:
        for got, want in zip(kernel_lm.forward(step), torch_lm.forward(step)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if device == "cpu":  # captured kernels run at replay without a Python call to count
        assert kernel_calls and all(shape[2] <= 8 for shape in kernel_calls), kernel_calls
    print("model ok")
    """
)


HEAD_WITH_KERNEL = COUNT_KERNEL_CALLS + textwrap.dedent(
    """
    import sys
    import torch
    from specdec.heads import build_head_proposer
    from specdec.heads.cuda_graphs import StaticHeadRunner
    from specdec.types import ProposeRequest, SamplingParams

    target_dir, head_dir, device = sys.argv[1], sys.argv[2], sys.argv[3]
    kernel, torch_path = (build_head_proposer("eagle3", head_dir, target_dir, "float32", device, max_num_seqs=2,
                                              cuda_graphs=graphs) for graphs in (device == "cuda", False))
    kernel.head.use_triton_attention()
    torch_path.head.layers[0].self_attn.kernel, torch_path.head.triton_attention = None, False  # the default on CPU
    if device == "cpu":
        kernel.graphs = StaticHeadRunner(kernel.head, kernel.cache)
    hidden = torch.randn(12, kernel.head.config.feature_size, device=device)  # [tokens, features]
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        requests = [ProposeRequest("a", 0, list(range(1, 13)), 4, sampling, seed=3, hidden_states=hidden)]
        got, want = kernel.propose(requests)[0], torch_path.propose(requests)[0]
        assert got.token_ids.tolist() == want.token_ids.tolist(), (got.token_ids, want.token_ids)
        if not sampling.greedy:
            torch.testing.assert_close(got.probs, want.probs, atol=1e-4, rtol=0)
    if device == "cpu":
        assert kernel_calls, "the head's fixed-shape passes never reached the kernel"
    print("head ok")
    """
)


def run_script(script: str, *args: str, interpret: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_kernel_and_model_match_torch_path_interpreted(tmp_path):
    """One interpreter process for both checks: its start-up dominates their cost."""
    path, _ = save_checkpoint(tmp_path)
    run_script(KERNEL_VS_TORCH + MODEL_WITH_KERNEL, str(path), "cpu", interpret=True)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="kernel can run")
def test_kernel_unavailable_is_a_clear_error(tmp_path):
    path, _ = save_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="triton_attention=True needs a CUDA device or TRITON_INTERPRET=1"):
        FastCausalLM(path, dtype="float32", triton_attention=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_torch_path_on_cuda(tmp_path):
    path, _ = save_checkpoint(tmp_path)
    run_script(KERNEL_VS_TORCH + MODEL_WITH_KERNEL, str(path), "cuda", interpret=False)


def _head_pair(tmp_path):
    from eagle3_heads import DRAFT_VOCAB, VOCAB, random_head
    from tiny_llama import build_tiny_llama

    from specdec.heads.formats import save_eagle3

    build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6,
                     initializer_range=0.3).save_pretrained(tmp_path / "target")  # fmt: skip
    head = random_head(tmp_path / "target", 1, DRAFT_VOCAB, num_layers=2)  # the first layer and a plain one
    save_eagle3(head, tmp_path / "head", verifier=str(tmp_path / "target"))
    return str(tmp_path / "target"), str(tmp_path / "head")


def test_eagle3_head_with_the_kernel_drafts_as_with_torch_interpreted(tmp_path):
    run_script(HEAD_WITH_KERNEL, *_head_pair(tmp_path), "cpu", interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eagle3_head_with_the_kernel_drafts_as_with_torch_on_cuda(tmp_path):
    run_script(HEAD_WITH_KERNEL, *_head_pair(tmp_path), "cuda", interpret=False)


def test_the_kernel_is_the_default_on_cuda_only(tmp_path):
    path, _ = save_checkpoint(tmp_path)
    assert FastCausalLM(path, dtype="float32", max_num_seqs=1, max_model_len=16).model.model.layers[0].self_attn.kernel is None
    assert default_triton_attention("cuda:0") and not default_triton_attention("cpu")
