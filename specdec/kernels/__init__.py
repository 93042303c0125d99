"""Triton kernels for the sampling hot path; each agrees exactly with a torch function in the package."""
from __future__ import annotations

import os

import torch


def load_rejection_kernel():
    """The Triton batch sampler, with the signature of ``rejection_sampler.rejection_sample_batch``.

    Imported lazily so that the package works without Triton; raises when the kernel
    cannot run here (needs CUDA, or ``TRITON_INTERPRET=1`` set before Triton is used).
    """
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(
            "use_triton_kernel=True needs a CUDA device or TRITON_INTERPRET=1; "
            "use use_triton_kernel=False for the torch path"
        )
    try:
        from specdec.kernels.rejection import rejection_sample_triton
    except ImportError as error:
        raise RuntimeError(f"use_triton_kernel=True needs the triton package: {error}") from error
    return rejection_sample_triton
