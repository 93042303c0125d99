"""The analytic speedup bound of speculative decoding, and the step times it needs.

With ``k`` drafts per step and mean accepted length ``L`` (tokens emitted per target
pass that drafted: accepted + 1), one step costs a target pass over ``k + 1`` tokens
plus ``k`` draft passes, and replaces ``L`` plain decoding steps (Leviathan et al.
2023, Sec. 3.4; Chen et al. 2023, Sec. 3):

    speedup_bound = L * T_target(1) / (T_target(k + 1) + k * T_draft(1))

An n-gram proposer costs no model pass: ``T_draft = 0``. It also finds nothing to
propose at some steps; such a step is a plain one (one token for ``T_target(1)``).
With a share ``f`` of the decode steps drafting, tokens and cost per step are averaged:

    speedup_bound = (f * L + 1 - f) * T_target(1)
                    / (f * (T_target(k + 1) + k * T_draft(1)) + (1 - f) * T_target(1))

which is the first form at ``f = 1``. The bound ignores everything but model compute
(sampling, orchestration, transport), so the measured speedup over ``k = 0`` divided
by the bound -- the *efficiency* -- is the share of the ideal that the serving path keeps.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from specdec.cached_lm import CachedLM, ForwardCall
from specdec.fast.runner import FastCausalLM
from specdec.models import CachedCausalLM

# One forward of one sequence: (seq_id, position, token_ids, num_logits) -> logits
ForwardFn = Callable[[str, int, list[int], int], object]


def speedup_bound(
    mean_accepted_length: float,
    k: int,
    t_target_1: float,
    t_target_k1: float,
    t_draft_1: float,
    drafting_fraction: float = 1.0,
) -> float:
    """Ideal speedup over plain decoding; times in any one unit. NaN when L is unknown (and needed)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if min(t_target_1, t_target_k1) <= 0 or t_draft_1 < 0:
        raise ValueError(
            f"step times must be positive (draft: >= 0), got T_target(1)={t_target_1}, "
            f"T_target(k+1)={t_target_k1}, T_draft(1)={t_draft_1}"
        )
    if not 0.0 <= drafting_fraction <= 1.0:
        raise ValueError(f"drafting_fraction must be in [0, 1], got {drafting_fraction}")
    if drafting_fraction == 0.0:
        return 1.0  # every step was a plain one
    if math.isnan(mean_accepted_length):
        return math.nan
    if not 1.0 <= mean_accepted_length <= k + 1:
        raise ValueError(f"mean_accepted_length must be in [1, k + 1 = {k + 1}], got {mean_accepted_length}")
    f = drafting_fraction
    tokens = f * mean_accepted_length + (1.0 - f)
    cost = f * (t_target_k1 + k * t_draft_1) + (1.0 - f) * t_target_1
    return tokens * t_target_1 / cost


def efficiency(measured_speedup: float, bound: float) -> float:
    return measured_speedup / bound if bound > 0 else math.nan


def forward_ms(
    shapes: dict[str, tuple[torch.nn.Module | FastCausalLM, int]],
    context_len: int,
    repeats: int = 20,
    warmup: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Median wall time (ms) of one forward per ``{name: (model, num_tokens)}`` on a ``context_len``-token KV cache.

    A model is a Hugging Face module, timed through :class:`~specdec.models.CachedCausalLM`
    (the ``hf`` engine's cache owner), or a :class:`~specdec.fast.FastCausalLM` (the ``fast``
    engine), so the bound is computed from the engine the server runs. Each repeat cuts the
    cache back to ``context_len`` first, as a rejected draft does, so every repeat sees the
    same cache length. The shapes are timed in turn within each round, so a burst of load
    elsewhere on the machine skews them alike.
    """
    if context_len < 1 or any(n < 1 for _, n in shapes.values()):
        raise ValueError(f"context_len and every num_tokens must be >= 1, got {context_len} and {shapes}")
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for name, (model, num_tokens) in shapes.items():
        forward, lm = _one_sequence_forward(model)
        ids = torch.randint(0, lm.vocab_size, (context_len + num_tokens,), generator=gen).tolist()
        forward(name, 0, ids[:context_len], 1)
        runs.append((name, forward, lm, ids[context_len:]))
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for i in range(warmup + repeats):
        for name, forward, lm, step in runs:
            synchronize(lm.device)
            start = time.perf_counter()
            forward(name, context_len, step, len(step))
            synchronize(lm.device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    for name, _, lm, _ in runs:
        lm.release(name)  # the timing sequences leave no slot taken
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _one_sequence_forward(model: torch.nn.Module | CachedLM) -> tuple[ForwardFn, CachedLM]:
    """A one-call forward over ``model``'s ``CachedLM`` (a Hugging Face module gets the ``hf`` engine's)."""
    lm = CachedCausalLM(model) if isinstance(model, torch.nn.Module) else model

    def forward(seq_id: str, position: int, ids: list[int], num_logits: int):
        return lm.forward([ForwardCall(seq_id, position, ids, num_logits)])

    return forward, lm


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU), so wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
