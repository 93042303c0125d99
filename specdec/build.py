"""Build the ``CachedLM`` a served model runs on, from its config's ``engine``.

One factory, so the draft proposer and the target verifier load their checkpoints
the same way and each adapter only names the engine.
"""
from __future__ import annotations

import os

import torch

from specdec.cached_lm import ENGINES, CachedLM, check_model_dir
from specdec.fast.runner import FastCausalLM
from specdec.models import CachedCausalLM
from specdec.progress import Log, timed_phase



def build_lm(
    path: str | os.PathLike,
    engine: str = "fast",
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    log: Log | None = None,
    cpu_compile: bool = False,
    warm_trees: bool = False,
) -> CachedLM:
    """The checkpoint at ``path`` on ``engine``; ``max_model_len`` None: the model's ``max_position_embeddings``.

    The fast engine preallocates ``max_num_seqs`` cache slots, so it needs a number;
    the ``hf`` engine grows a cache per sequence and takes None as unbounded. ``log``, when
    given, gets a line as each load phase starts and ends, with its seconds. ``cpu_compile``
    compiles the fast engine's forward where it runs on CPU (``specdec.fast.cpu_compile``);
    on a GPU, which captures CUDA graphs instead, it changes nothing, so one configuration
    serves on both. ``warm_trees``: the compile covers draft trees' passes (the drafter makes trees).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    check_model_dir(path)
    if engine == "hf":
        if cpu_compile:
            raise ValueError("cpu_compile needs engine 'fast' (the hf engine runs transformers' own forward)")
        with timed_phase(log, f"loading {path} to {device}"):
            return CachedCausalLM.from_path(path, dtype, device, max_num_seqs, max_model_len)
    if max_num_seqs is None:
        raise ValueError("the fast engine preallocates its cache: max_num_seqs must be given")
    on_cpu = torch.device(device).type == "cpu"
    return FastCausalLM(path, dtype, device, max_num_seqs, max_model_len, cpu_compile=cpu_compile and on_cpu, log=log,
                        warm_trees=warm_trees)  # fmt: skip
