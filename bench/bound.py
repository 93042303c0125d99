"""The analytic speedup bound of speculative decoding, and the step times it needs.

With ``k`` drafts per step and mean accepted length ``L`` (tokens emitted per target
pass that drafted: accepted + 1), one step costs a target pass over ``k + 1`` tokens
plus ``k`` draft passes, and replaces ``L`` plain decoding steps (Leviathan et al.
2023, Sec. 3.4; Chen et al. 2023, Sec. 3):

    speedup_bound = L * T_target(1) / (T_target(k + 1) + k * T_draft(1))

A draft head (EAGLE-3, MLP speculator) is timed by the proposal: ``k * T_draft(1)`` is what one
call for ``k`` drafts costs it (``propose_ms``), its catch-up over the step's new rows included.
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
from specdec.types import ProposeRequest, SamplingParams

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


def propose_ms(
    proposer, feature_size: int, vocab_size: int, context_len: int, ks: list[int], repeats: int = 20,
    warmup: int = 5, seed: int = 0, between: Callable[[], None] | None = None,
) -> dict[int, float]:
    """Median wall time (ms) of one ``k``-draft proposal of a head (``proposer``, reading ``feature_size``
    target features a row) for each of ``ks``, one greedy sequence, as served in steady state.

    The sequence is first sent ``context_len`` tokens and their features; each timed call then
    sends two more of each (an accepted draft and the bonus token, the last token's replaced),
    as a step that accepted one draft does. Features are random: a head's cost does not depend
    on their values. ``between`` runs untimed before each proposal (a target forward, as a step
    verifies before it proposes: ``forward_ms`` times the draft model's step among the target's too).
    """
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(proposer.device)

    def features(n: int) -> torch.Tensor:  # [n, feature_size]
        return torch.randn(n, feature_size, generator=gen)

    out = {}
    for k in ks:
        seq_id, length = f"bench-propose-{k}", context_len
        ids = torch.randint(0, vocab_size, (context_len + warmup + repeats + 1,), generator=gen).tolist()
        proposer.propose([ProposeRequest(seq_id, 0, ids[:context_len], k, SamplingParams(), seed,
                                         hidden_states=features(context_len - 1))])  # fmt: skip
        times = []
        try:
            for i in range(warmup + repeats):
                request = ProposeRequest(seq_id, length - 1, ids[length - 1 : length + 1], k, SamplingParams(), seed,
                                         hidden_states=features(2), hidden_position=length - 2)  # fmt: skip
                if between is not None:
                    between()
                synchronize(device)
                start = time.perf_counter()
                proposer.propose([request])
                synchronize(device)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                length += 1
        finally:
            proposer.release(seq_id)
        out[k] = 1e3 * statistics.median(times)
    return out


def head_propose_ms(
    method: str, head, target, target_hidden_size: int, ks: list[int], dtype: str, device: str,
    cpu_compile: bool, cuda_graphs: bool | None, context_len: int, repeats: int, seed: int = 0,
    target_lm: torch.nn.Module | CachedLM | None = None,
) -> dict[str, float]:
    """``{"<method>_propose_<k>": ms}``: a head's ``k``-draft proposal (``propose_ms``), loaded as the
    server loads it, each after a one-token forward of ``target_lm`` (untimed); an MLP speculator's
    only for ``k`` up to its ``n_predict``, Medusa's up to its ``num_heads``, DFlash's up to ``block_size - 1``."""
    from specdec.heads import build_head_proposer

    proposer = build_head_proposer(method, head, target, dtype, device, max_num_seqs=1, cpu_compile=cpu_compile,
                                   cuda_graphs=cuda_graphs)  # fmt: skip
    most = {"mlp_speculator": lambda: proposer.model.n_predict, "medusa": lambda: proposer.num_heads,
            "dflash": lambda: proposer.max_drafts}  # fmt: skip
    ks = [k for k in ks if k >= 1 and (method not in most or k <= most[method]())]
    feature_size = len(proposer.hidden_state_layers) * target_hidden_size
    between = None
    if target_lm is not None:
        forward, lm = _one_sequence_forward(target_lm)
        forward("bench-between", 0, list(range(context_len)), 1)
        between = lambda: forward("bench-between", context_len, [0], 1)  # noqa: E731  cut back to context_len
    try:
        times = propose_ms(proposer, feature_size, proposer.vocab_size, context_len, ks, repeats, seed=seed,
                           between=between)  # fmt: skip
    finally:
        if target_lm is not None:
            lm.release("bench-between")
    return {f"{method}_propose_{k}": ms for k, ms in times.items()}


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
