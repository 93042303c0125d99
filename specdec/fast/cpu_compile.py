"""The fast engine's forward compiled for CPU with ``torch.compile`` (inductor's C++ backend).

On a GPU, CUDA graphs remove the per-op cost of a small decode step (``cuda_graphs.py``).
On CPU that cost is the Python and dispatcher work around each of the few hundred small
ops of a pass -- norms, rotary, reshapes, cache indexing -- and for a small model it
outweighs the matrix products. Inductor fuses the pointwise ops into generated C++ loops
and leaves the products to the BLAS, so a pass runs as one call.

Shapes are compiled dynamic (batch, tokens per row and attended cache length are
symbols), so a server compiles a handful of graphs at load -- one token or several per
row, one row or several, as torch specialises sizes 0 and 1 -- instead of one per shape.
:func:`warm_up` runs those passes once, so the compile time lands on the load, not on
the first requests. The cache write indexes the cache tensor itself (``llama.write_kv``):
traced as indexing into a view of the cache, the write would be functionalised into a
copy of the whole cache on every pass.

The linears stay the oneDNN-packed ones of ``cpu_linear.py``, called from the graph as
an opaque custom op: left to inductor, a linear goes to MKL's GEMM, whose skinny-matrix
paths make a verify pass of a few tokens cost far more than a one-token step, which is
what speculation must not pay. Numerics are those of the eager forward up to the order
of float sums.
"""
from __future__ import annotations

import locale
import shutil
from collections.abc import Callable

import torch
from torch import nn

from specdec.cached_lm import CachedLM, ForwardCall
from specdec.compile_locks import CompileProgress

WARM_UP_PREFIX = 16  # tokens each warm-up sequence caches first (a prefill pass), as a prompt would
WARM_UP_SHAPES = ((1, 1), (1, 5), (2, 1), (2, 5))  # (sequences, tokens each) after it: decode and verify passes
WARM_UP_SEQ_ID = "\x00cpu-compile-warm-up"  # a seq_id no caller sends: it holds slots only during warm_up
# Graphs torch keeps per code object, and every FastLlama shares ``forward``'s: a draft and a
# target in one process (tests, the benchmark) each need about four (sizes 0/1 specialised)
GRAPHS_PER_FORWARD = 64


def check_compiler() -> None:
    """Inductor's CPU backend builds C++ at load: name what is missing before it fails deep inside."""
    from torch._inductor import config

    candidates = [c for c in config.cpp.cxx if c]  # the compilers inductor tries, in order
    if not any(shutil.which(c) for c in candidates):
        raise RuntimeError(
            f"cpu_compile needs a C++ compiler on PATH (inductor looks for {', '.join(candidates)}): "
            "install g++, or set cpu_compile false"
        )


def use_utf8_text_files() -> None:
    """Inductor reads its code templates with ``open()``'s default encoding, the locale's.

    A Triton Python stub embeds its interpreter, which Python does not move from the C
    locale to UTF-8 (PEP 538 applies to the ``python`` command only), so the templates'
    non-ASCII bytes fail to decode there. The stub is this model's own process: switching
    its character type to UTF-8 is local to it.
    """
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    except locale.Error:
        raise RuntimeError(
            "cpu_compile needs a UTF-8 locale and C.UTF-8 is not installed: start tritonserver with "
            "LANG set to a UTF-8 locale, or set cpu_compile false"
        ) from None


def compile_forward(model: nn.Module) -> Callable[..., torch.Tensor]:
    """``model.forward`` (a ``FastLlama``'s, an EAGLE-3 head's) compiled for every shape (``dynamic=True``);
    one graph, no breaks.

    Torch's config overrides are per thread, and a served model runs its passes on the
    thread of the call that asks (a socket's, Triton's), not the one that loaded it: each
    call raises its own thread's recompile limit first, or a head's graphs compiled there
    would stop the forward at torch's default of eight per code object.
    """
    return compile_dynamic(model.forward)


def compile_dynamic(function: Callable) -> Callable:
    """``function`` compiled for every shape (``dynamic=True``) as one graph, no breaks: ``compile_forward``'s
    compile, for a function that runs a model's forward among other ops (``specdec.heads.compiled_steps``)."""
    check_compiler()
    use_utf8_text_files()
    compiled = torch.compile(function, dynamic=True, fullgraph=True)

    def call(*args, **kwargs):
        if torch._dynamo.config.recompile_limit < GRAPHS_PER_FORWARD:
            torch._dynamo.config.recompile_limit = GRAPHS_PER_FORWARD  # this thread's override
        return compiled(*args, **kwargs)

    return call


def warm_up_plan(free_slots: int, max_model_len: int) -> tuple[list[str], list[tuple[int, int]]]:
    """The warm-up sequences' ids and the ``(sequences, tokens each)`` passes to run after their prefill.

    Shapes of more sequences than there are free slots are left out, as no pass will have
    them; a model too short for the prefill and the longest pass gets no plan (it compiles
    on its first passes instead).
    """
    if max_model_len < WARM_UP_PREFIX + max(tokens for _, tokens in WARM_UP_SHAPES):
        return [], []
    shapes = [(rows, tokens) for rows, tokens in WARM_UP_SHAPES if rows <= free_slots]
    return [f"{WARM_UP_SEQ_ID}-{i}" for i in range(max(rows for rows, _ in shapes))], shapes


WARM_UP_TREE = (-1, -1, 0, 0, 1)  # a small draft tree: two levels, two children a node; its graphs fit any tree


def warm_up(lm: CachedLM, hidden_layers: tuple[int, ...] = (), trees: bool = False,
            progress: CompileProgress | None = None) -> None:
    """Run a prefill and each pass of ``warm_up_plan`` through ``lm``, on free slots given back after.

    Runs at load, before any sequence holds a slot, through the same calls requests make,
    so every graph they need is compiled here; with ``hidden_layers``, through
    ``forward_with_hidden`` (a head's verify passes), whenever a head first asks for them.
    ``trees``: draft trees' passes too (``ForwardCall.tree_parents``), whose mask and rotary
    positions are inputs of graphs of their own: left to the first tree a request drafts,
    their compile stalled that step for tens of seconds. ``progress`` is told each pass's shape as it
    starts, so a load says which shape it compiles and how long each took.
    """
    seq_ids, shapes = warm_up_plan(lm.max_num_seqs - lm.num_active_sequences, lm.max_model_len)

    def run(shape: str | None, calls: list[ForwardCall]) -> None:  # shape: a new step of the progress
        if progress is not None and shape is not None:
            progress.step(shape)
        lm.forward_with_hidden(calls, hidden_layers) if hidden_layers else lm.forward(calls)

    try:
        for i, seq_id in enumerate(seq_ids):
            run(None if i else f"{len(seq_ids)} prefill(s) of {WARM_UP_PREFIX} tokens",
                [ForwardCall(seq_id, 0, [0] * WARM_UP_PREFIX, 1)])
        for rows, tokens in shapes:
            run(f"{rows} sequence(s) x {tokens} token(s)",
                [ForwardCall(seq_id, WARM_UP_PREFIX, [0] * tokens, tokens) for seq_id in seq_ids[:rows]])
        n = len(WARM_UP_TREE) + 1
        for rows in sorted({1, len(seq_ids)}) if trees else ():  # torch specialises one row
            run(f"{rows} sequence(s) x a draft tree of {n} tokens",
                [ForwardCall(seq_id, WARM_UP_PREFIX, [0] * n, n, WARM_UP_TREE) for seq_id in seq_ids[:rows]])
    finally:
        for seq_id in seq_ids:
            lm.release(seq_id)
