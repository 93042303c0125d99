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

MODEL_WITH_KERNEL = textwrap.dedent(
    """
    import sys
    import torch
    from specdec.fast import FastCausalLM, ForwardCall

    calls = [
        [ForwardCall("a", 0, list(range(1, 40)), 2), ForwardCall("b", 0, [7, 8, 9], 1)],
        [ForwardCall("a", 38, [5, 6, 7], 3), ForwardCall("b", 3, [1], 1)],
    ]
    lms = [FastCausalLM(path, "float32", device, 2, 64, False, triton_attention=t) for t in (True, False)]
    for step in calls:
        for got, want in zip(*(lm.forward(step) for lm in lms)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    print("model ok")
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
