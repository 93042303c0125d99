"""Draft trees on the wire (``specdec.tree``): each sequence's parents, or the path a step accepted.

A per-sequence list of node indices goes as one flat array plus ``num_<name>``, as
``packing`` lays lists, with ``num_<name>`` = ``CHAIN`` (-1) for a sequence without a
tree. A request none of whose sequences has a tree carries none of these tensors, so a
chain's requests are what they were; an answer always carries them (Triton answers every
output a caller names), as ``CHAIN`` for each chain.

* draft_proposer answers ``draft_parents`` with its proposals (``Proposal.parents``);
* target_verifier takes ``tree_parents`` (``VerifyRequest.tree_parents``) and
  ``accepted_path`` (the nodes the previous step accepted, whose cache moves into place);
* rejection_sampler takes ``draft_parents`` and answers ``accepted_nodes``
  (``SampleResult.accepted_nodes``), which target_verifier passes back when it samples.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specdec_triton.packing import each, flat, i32
from specdec_triton.plumbing import RequestError

CHAIN = -1  # num_<name> of a sequence without a tree
PROPOSAL_TREE_OUTPUTS = ("draft_parents", "num_draft_parents")
VERIFY_TREE_INPUTS = ("tree_parents", "num_tree_parents", "accepted_path", "num_accepted_path")
SAMPLE_TREE_INPUTS = PROPOSAL_TREE_OUTPUTS
SAMPLE_TREE_OUTPUTS = ("accepted_nodes", "num_accepted_nodes")


def lists_out(name: str, lists: Sequence[Sequence[int] | None]) -> dict[str, np.ndarray]:
    """``name`` and ``num_<name>`` for every sequence, ``CHAIN`` where it has no list."""
    return {
        name: flat([values for values in lists if values is not None]),
        f"num_{name}": i32([CHAIN if values is None else len(values) for values in lists]),  # [S]
    }


def lists_in(name: str, lists: Sequence[Sequence[int] | None]) -> dict[str, np.ndarray]:
    """``lists_out``, or nothing when no sequence has a list (a chain's request stays as it was)."""
    return lists_out(name, lists) if any(values is not None for values in lists) else {}


def lists_of(inputs: Mapping[str, np.ndarray], name: str, count: int) -> list[tuple[int, ...] | None]:
    """The lists ``lists_out`` laid out: one tuple per sequence, None for a chain (all None when absent)."""
    lengths = each(inputs, f"num_{name}", count, int, CHAIN)
    if any(n < CHAIN for n in lengths):
        raise RequestError(f"input 'num_{name}' must hold lengths >= 0 ({CHAIN}: no tree), got {lengths}")
    values = np.asarray(inputs.get(name, np.zeros(0, np.int64))).reshape(-1).tolist()
    if sum(max(n, 0) for n in lengths) != len(values):
        raise RequestError(f"input '{name}' holds {len(values)} values but 'num_{name}' adds up to "
                           f"{sum(max(n, 0) for n in lengths)}")  # fmt: skip
    out, start = [], 0
    for n in lengths:
        out.append(None if n == CHAIN else tuple(int(v) for v in values[start : start + n]))
        start += max(n, 0)
    return out
