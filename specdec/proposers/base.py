"""The proposer protocol: a strategy that guesses the next k tokens of a sequence.

Modelled on transformers' ``CandidateGenerator``: two methods, one implementation
per file (``draft_model.py``, ``ngram.py``). Proposals only affect speed, never the
output distribution: the rejection sampler corrects whatever is proposed.

A proposer is stateful: each ``ProposeRequest`` carries only the tokens it has not
been sent, at ``position``, and it keeps the sequence until ``release``. So the
caller never resends a whole sequence, and a step that drafts nothing (and sends
nothing) is caught up by the next request, whose tokens start where the last ended.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.types import Proposal, ProposeRequest


@dataclass(frozen=True)
class DraftLimit:
    """The most drafts one call may ask of a drafter whose checkpoint fixes it, and what in it does.

    Read by the proposer at each call (:func:`check_draft_limit`) and by a server's load, which refuses
    a configuration whose steps would ask more; both errors name the setting.
    """

    most: int
    drafter: str  # what drafts, for errors: "an MLP speculator"
    setting: str  # the checkpoint's setting behind the limit: "n_predict=3"
    counts: str  # what that setting counts: "stages"
    bound: str  # the limit as a request's error states it: "n_predict"


def check_draft_limit(requests: list[ProposeRequest], limit: DraftLimit) -> None:
    """Refuse, naming the setting, a request for more drafts than the drafter's checkpoint allows."""
    for r in requests:
        if r.num_tokens > limit.most:
            raise ValueError(f"seq {r.seq_id!r}: {r.num_tokens} drafts asked of {limit.drafter} with {limit.setting}; "
                             f"num_speculative_tokens must be at most {limit.bound}")


@runtime_checkable
class Proposer(Protocol):
    """Every proposer subclasses this, so that what it declares is read, never probed for.

    ``hidden_state_layers``: the target's hidden states a head reads
    (``VerifyRequest.hidden_layers``); ``draft_limit``: set where the checkpoint caps a call's
    drafts (a load refuses a configuration that would ask more).
    """

    hidden_state_layers: tuple[int, ...] = ()
    draft_limit: DraftLimit | None = None

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        """One proposal of at most ``request.num_tokens`` tokens per request, in order."""
        ...

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:
        """Forget any state kept for ``seq_id``; a no-op for unknown ids.

        ``response``: the sequence's output, given only when its request completed
        (not when it was cancelled or failed); a proposer that learns from past
        responses (suffix decoding) keeps it, the others ignore it.
        """
        ...


def check_propose_requests(requests: list[ProposeRequest], num_held: Callable[[str], int]) -> None:
    """Refuse, before any state moves, a request the proposer cannot place in its sequence.

    ``num_held(seq_id)``: how many tokens of the sequence the proposer was sent. A
    request may continue them or cut them back, never leave a gap: the proposer would
    draft from a sequence with tokens missing.
    """
    seq_ids = [r.seq_id for r in requests]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"a propose call may hold each seq_id once, got {seq_ids}")
    for r in requests:
        if r.num_tokens < 0:
            raise ValueError(f"seq {r.seq_id!r}: num_tokens must be >= 0, got {r.num_tokens}")
        held = num_held(r.seq_id)
        if not 0 <= r.position <= held:
            raise ValueError(
                f"seq {r.seq_id!r}: position {r.position} is past the {held} tokens the proposer holds; "
                f"a request may only continue or cut back the sequence it was sent"
            )
        if r.position == 0 and not r.token_ids:
            raise ValueError(
                f"seq {r.seq_id!r}: token_ids is empty at position 0 (the proposer holds {held} tokens); "
                f"there is no sequence to draft from"
            )


def proposals_in_order(
    requests: list[ProposeRequest],
    drafting: list[ProposeRequest],  # those of ``requests`` that drafted, in the order of ``drafts``
    drafts: list[list[int]],
    q_rows: list[list[torch.Tensor]],  # per drafting request, one [1, vocab] q row per draft
) -> list[Proposal]:
    """One proposal per request, in order: its drafts and q if it drafted, an empty proposal if not.

    The ids stay on the host, where the drafting loop read them: their readers take them
    as lists (the greedy match, the wire) or move a batch at once (the sampler), so a
    tensor per sequence on the model's device would be a copy there and back for each.
    ``q`` stays where it was computed.
    """
    by_seq = {r.seq_id: i for i, r in enumerate(drafting)}
    proposals = []
    for r in requests:
        i = by_seq.get(r.seq_id)
        ids = drafts[i] if i is not None else []
        probs = torch.cat(q_rows[i]) if i is not None and q_rows[i] else None  # [k, vocab] q
        proposals.append(Proposal(torch.tensor(ids, dtype=torch.long), probs))  # [k], on the host
    return proposals


def drafts_as_chain(tree, requests: Sequence[ProposeRequest]) -> bool:
    """Whether a static ``tree`` (``specdec.tree.DraftTree``, or None) drafts these requests as the chain its cut is.

    A loaded step asks fewer nodes than the tree has (the batch-size table), and a cut below
    the tree's depth is the chain (``DraftTree.first``). Drafted and verified as a chain, it
    takes the chain's faster paths (a head's compiled greedy steps, the target's chain pass).
    Greedy requests only: a sampled request keeps the tree's rule (chosen drafts, SpecInfer's
    verification), under which its seeded text is k = 0's whatever the cut, where a sampled chain's
    drafts would consume other draws.
    """
    return tree is None or all(r.sampling.greedy and tree.first(r.num_tokens).is_chain for r in requests)
