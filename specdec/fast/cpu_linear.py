"""Linear layers for CPU decoding, with weights prepacked once for oneDNN.

A decode or verify pass multiplies every weight by a handful of rows (``k + 1``
tokens per sequence). On CPU, ``F.linear`` sends that through MKL's GEMM, whose
skinny-matrix paths vary two- to four-fold with the row count: on a 2-core EPYC,
a 125M Llama's forward took 35 ms for one token and 66 ms for five. Speculation
then gains little, because verifying ``k + 1`` tokens costs almost twice a plain
step. oneDNN with the weight reordered once into its blocked layout (what
inductor's CPU freezing pass does) streams the weights near memory bandwidth for
3-8 rows; 1-2 rows are slower there, so such passes are padded to ``MIN_ROWS``.
A verify pass then costs about what a one-token step costs, which is the premise
of speculative decoding (the same model on the same machine: 33 ms for one token
and for five). Small weights, which stay in cache and where a call's fixed cost
dominates, also keep a dense copy for one-row passes (a draft model's steps) in a
model small enough that both copies stay in cache (``DENSE_COPIES_MAX_MODEL_BYTES``),
and the smallest (under ``PACK_MIN_ELEMENTS``) are not packed at all.

The packed weight is an opaque oneDNN tensor; the numerics are those of an fp32
(or bf16) GEMM, equal to ``F.linear`` up to summation order.

``torch.compile`` (``cpu_compile.py``) cannot trace an opaque tensor, and inductor's own
way to the same kernels -- freezing -- embeds the packed weights in the graph, which then
cannot be cached on disk (a minute of compiling on every load of the shipped target). So
the multiplication is the custom op ``specdec::onednn_linear``: a compiled graph calls it
as one opaque step with a small key tensor, and the op finds its packed weight in a
table this module owns. The row padding and the one-row dense path live inside the op,
so a traced graph has no branch on the row count.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4  # passes of fewer rows are padded: oneDNN's 3-6 row kernels beat its 1-2 row ones
PACKING_BATCH_HINT = 8  # the row count the blocked layout is tuned for (decode and verify sizes)
PACK_MIN_ELEMENTS = 1 << 17  # smaller weights stay nn.Linear: a oneDNN call's fixed cost outweighs its gain
DENSE_COPY_MAX_ELEMENTS = 1 << 20  # weights below this keep a dense copy for one-row passes (4 MiB in fp32)
# Dense copies double what a model's packed linears occupy, and pay only while both copies stay
# in the last-level cache: on the 2-core EPYC (32 MB L3) they made the shipped draft's one-token
# step 12 % faster (2 MB of packed weights) and the EAGLE-3 head's proposal 6 % (1 MB), but the
# shipped target's one-token step 15 % slower (21 MB: 2.3 against 2.0 ms). So a model whose
# packed linears exceed this keeps none.
DENSE_COPIES_MAX_MODEL_BYTES = 16 << 20
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can run ``PackedLinear`` for ``dtype``."""
    return (
        dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@dataclass(frozen=True)
class _PackedWeights:
    packed: torch.Tensor  # oneDNN's blocked layout of [out_features, in_features]
    dense: torch.Tensor | None  # [out_features, in_features] for one-row passes; None for a large weight
    bias: torch.Tensor | None  # [out_features]


_PACKED: dict[int, _PackedWeights] = {}  # PackedLinear.key's value -> its weights; entries leave with their module
_NEXT_KEY = itertools.count()


def _linear(x: torch.Tensor, weights: _PackedWeights) -> torch.Tensor:
    """``x [N, in_features] -> [N, out_features]``."""
    n = x.shape[0]
    if n == 1 and weights.dense is not None:
        return F.linear(x, weights.dense, weights.bias)
    rows = x.contiguous() if n >= MIN_ROWS else F.pad(x, (0, 0, 0, MIN_ROWS - n))  # [max(N, MIN_ROWS), in]
    out = torch.ops.mkldnn._linear_pointwise(rows, weights.packed, weights.bias, "none", [], "")
    # a few rows copied: a custom op returns a tensor of its own, not a view into a padded one
    return out if n >= MIN_ROWS else out[:n].clone()  # [N, out_features]


@torch.library.custom_op("specdec::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    """``_linear`` with the weights registered under ``key`` ([1] int64), for a traced graph."""
    return _linear(x, _PACKED[int(key)])


@onednn_linear.register_fake
def _(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference on CPU; built from a loaded ``nn.Linear``, whose weight it replaces."""

    def __init__(self, linear: nn.Linear, dense_copy: bool = True):
        """``dense_copy``: keep a dense copy of a small weight for one-row passes (``pack_linears`` decides
        per model)."""
        super().__init__()
        weight = linear.weight.detach()  # [out_features, in_features]
        if weight.device.type != "cpu" or not cpu_packing_available(weight.dtype):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} for oneDNN")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = weight.dtype
        # a small weight stays cache-resident, where MKL's one-row GEMV beats a padded oneDNN pass
        # (the shipped draft's one-token steps got slower when packed); a copy of a small weight costs little
        self.weights = _PackedWeights(
            torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT),
            weight if dense_copy and weight.numel() < DENSE_COPY_MAX_ELEMENTS else None,
            None if linear.bias is None else linear.bias.detach(),
        )  # fmt: skip
        self.register_buffer("key", torch.tensor([next(_NEXT_KEY)]), persistent=False)  # [1] int64
        _PACKED[int(self.key)] = self.weights
        weakref.finalize(self, _PACKED.pop, int(self.key), None)

    @property
    def dense_weight(self) -> torch.Tensor | None:
        return self.weights.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        rows = x.reshape(-1, self.in_features)  # [N, in_features]
        if torch.compiler.is_compiling():  # the op's dispatch costs a few microseconds: eager calls straight in
            out = onednn_linear(rows, self.key, self.out_features)  # [N, out_features]
        else:
            out = _linear(rows, self.weights)
        return out.reshape(*x.shape[:-1], self.out_features)  # [..., out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.weights.bias is not None}"


def pack_linears(module: nn.Module) -> int:
    """Replace each ``nn.Linear`` under ``module`` of at least ``PACK_MIN_ELEMENTS`` weights by a
    ``PackedLinear``, with dense copies while they total at most ``DENSE_COPIES_MAX_MODEL_BYTES``;
    returns how many were replaced."""
    packable = list(_packable_linears(module))
    total = sum(child.weight.numel() * child.weight.element_size() for _, _, child in packable)
    for parent, name, child in packable:
        setattr(parent, name, PackedLinear(child, dense_copy=total <= DENSE_COPIES_MAX_MODEL_BYTES))
    return len(packable)


def _packable_linears(module: nn.Module):
    """(parent, attribute name, linear) of each linear ``pack_linears`` packs."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if child.weight.numel() >= PACK_MIN_ELEMENTS:
                yield module, name, child
        else:
            yield from _packable_linears(child)
