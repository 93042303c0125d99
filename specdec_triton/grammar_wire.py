"""The tensors of structured output (``specdec.grammar``): verification masks, and guides for the drafter.

Part of the wire (:mod:`specdec_triton.wire` calls these): a request leaves them out
unless one of its sequences has a grammar, so other steps carry nothing more. The masks
are the orchestrator's (the grammar matcher lives with the sequence's tokens);
target_verifier applies them to its logits before argmax and ``p``.
``guide_spec`` (draft_proposer) is one JSON object per sequence, empty for none: the guide
a sequence's first propose request carries, which draft_proposer follows while drafting
(:mod:`specdec.guided_drafts`).
``allowed_tokens`` is every masked row's ``ceil(vocab / 32)`` int32 words, rows of the
sequences in order, flattened; ``num_allowed_rows`` ``[S]`` says how many rows each
sequence has (its ``num_logits``, or 0: no grammar).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.types import GuideSpec, ProposeRequest, VerifyRequest
from specdec_triton.packing import each
from specdec_triton.plumbing import RequestError, bytes_array, texts

GRAMMAR_INPUTS = ("allowed_tokens", "num_allowed_rows")
GUIDE_INPUTS = ("guide_spec",)


def guide_inputs(requests: Sequence[ProposeRequest]) -> dict[str, np.ndarray]:
    specs = [r.guide_spec for r in requests]
    if all(s is None for s in specs):
        return {}
    return {"guide_spec": bytes_array(["" if s is None else json.dumps({
        "type": s.guide_type, "guide": s.guide, "output_start": s.output_start,
        "stop_token_ids": list(s.stop_token_ids)}) for s in specs])}  # fmt: skip


def with_guide_specs(requests: list[ProposeRequest], inputs: Mapping[str, np.ndarray]) -> list[ProposeRequest]:
    """``requests`` with the guides ``guide_spec`` carries; one that is not such an object is refused by name."""
    if "guide_spec" not in inputs:
        return requests
    specs = texts(inputs, "guide_spec")
    if len(specs) != len(requests):
        raise RequestError(f"input 'guide_spec' holds {len(specs)} items for {len(requests)} sequences")
    out = []
    for request, spec in zip(requests, specs):
        if not spec:
            out.append(request)
            continue
        try:
            item = json.loads(spec)
            guide = GuideSpec(str(item["type"]), str(item["guide"]), int(item["output_start"]),
                              tuple(int(t) for t in item["stop_token_ids"]))  # fmt: skip
        except (ValueError, KeyError, TypeError) as err:
            raise RequestError(f"seq {request.seq_id!r}: input 'guide_spec' is not a guide ({type(err).__name__}: "
                               f"{err}); it is an object with type, guide, output_start and "
                               f"stop_token_ids") from None  # fmt: skip
        out.append(replace(request, guide_spec=guide))
    return out


def grammar_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    masks = [r.allowed_tokens for r in requests]
    if all(m is None for m in masks):
        return {}
    rows = [0 if m is None else m.shape[0] for m in masks]
    words = np.concatenate([m.cpu().numpy().reshape(-1) for m in masks if m is not None]).astype(np.int32)
    return {"allowed_tokens": words, "num_allowed_rows": np.array(rows, np.int32)}  # [rows * words], [S]


def with_allowed_tokens(requests: list[VerifyRequest], inputs: Mapping[str, np.ndarray]) -> list[VerifyRequest]:
    """``requests`` with their masks; each masked sequence's rows must be its ``num_logits``, or 1 where its
    drafts are made in the call (beside the target: ``specdec.draft_beside_target`` masks the rows after them)."""
    if "num_allowed_rows" not in inputs:
        return requests
    rows = each(inputs, "num_allowed_rows", len(requests), int, 0)
    words = np.asarray(inputs.get("allowed_tokens", np.zeros(0, np.int32)), dtype=np.int32).reshape(-1)
    total = sum(rows)
    if total == 0 or len(words) % total:
        raise RequestError(f"input 'allowed_tokens' holds {len(words)} words, not a whole number of words for each "
                           f"of the {total} rows 'num_allowed_rows' counts")  # fmt: skip
    width = len(words) // total
    out, start = [], 0
    for request, n in zip(requests, rows):
        if n not in (0, 1, request.num_logits):
            raise RequestError(f"seq {request.seq_id!r}: input 'num_allowed_rows' is {n}, but num_logits is "
                               f"{request.num_logits}: every row of a masked sequence needs its mask (row 0's "
                               f"alone where the drafts are made beside the target)")  # fmt: skip
        mask = torch.from_numpy(words[start : start + n * width].reshape(n, width).copy()) if n else None
        out.append(replace(request, allowed_tokens=mask) if n else request)
        start += n * width
    return out
