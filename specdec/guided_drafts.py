"""A drafter in its own process drafts under a copy of each request's grammar.

The grammar's matcher belongs to the request's ``SequenceState``, in the scheduler's
process; a model drafter in another process (served: ``draft_proposer``) cannot ask it
what each next draft may be. So the scheduler sends the guide's text with a sequence's
first propose request (``ProposeRequest.guide_spec``, at position 0), and
:class:`GuidedDrafts`, in front of the proposer, compiles it for the same tokenizer
(xgrammar keeps what it compiled for the next request with the same guide) and keeps a
``GrammarState`` of its own, advanced by the committed output tokens each later request
brings. Each request reaches the proposer carrying it as its ``guide``, exactly as where
the grammar is in the drafter's process (``specdec.grammar``).

The copy only steers drafting. The scheduler's matcher still cuts forbidden drafts and makes
the verification masks, so a copy that fell behind (a sequence cut back below what it
consumed, a guide that does not compile here) costs acceptance, never correctness: the
sequence then drafts freely until its proposer starts it again at position 0.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specdec.grammar import GrammarCompiler, GrammarError, GrammarState
from specdec.proposers.base import Proposer
from specdec.types import GuideSpec, Proposal, ProposeRequest


@dataclass
class _Copy:
    state: GrammarState
    output_start: int  # sequence index of the first output token: the matcher takes tokens from there
    consumed: int = 0  # how many of the sequence's tokens the requests have brought

    def take(self, request: ProposeRequest) -> bool:
        """Advance by the request's committed output tokens; False where they do not continue the sequence
        (a cut back below what the matcher took, which it cannot be rolled back to here)."""
        if request.position != self.consumed:
            return False
        start = max(self.output_start - request.position, 0)  # the prompt's tokens are no output
        try:
            self.state.accept(request.token_ids[start:])
        except ValueError:  # not what the scheduler's matcher allowed: this copy is of no use
            return False
        self.consumed += len(request.token_ids)
        return True


class GuidedDrafts(Proposer):
    """A ``Proposer`` in front of another, giving each request the guide its sequence's spec describes."""

    def __init__(self, proposer: Proposer, compiler: Callable[[], GrammarCompiler], log: Callable[[str], None] = print):
        """``compiler``: makes the compiler for the target's tokenizer and vocabulary, at the first guided request."""
        self.proposer = proposer
        self.hidden_state_layers, self.draft_limit = proposer.hidden_state_layers, proposer.draft_limit
        self._make_compiler = compiler
        self._compiler: GrammarCompiler | None = None
        self._copies: dict[str, _Copy] = {}
        self._log = log

    @property
    def num_active_sequences(self) -> int:
        return self.proposer.num_active_sequences

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return self.proposer.propose([self._guided(r) for r in requests])

    def guide_of(self, seq_id: str) -> GrammarState | None:
        """The copy of the sequence's grammar at its committed tokens (as its last request left it); None if none."""
        copy = self._copies.get(seq_id)
        return None if copy is None else copy.state

    def release(self, seq_id: str, response: Sequence[int] | None = None) -> None:
        self._copies.pop(seq_id, None)
        self.proposer.release(seq_id, response)

    def _guided(self, request: ProposeRequest) -> ProposeRequest:
        if request.guide_spec is not None:
            self._copies.pop(request.seq_id, None)
            copy = self._start(request.seq_id, request.guide_spec)
            if copy is not None:
                self._copies[request.seq_id] = copy
        copy = self._copies.get(request.seq_id)
        if copy is None:
            return request
        if not copy.take(request):
            del self._copies[request.seq_id]  # drafts freely from here: the scheduler's matcher still cuts
            return request
        return replace(request, guide=copy.state, guide_spec=None)

    def _start(self, seq_id: str, spec: GuideSpec) -> _Copy | None:
        try:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            grammar = self._compiler.compile(spec.guide_type, spec.guide)
        except (GrammarError, OSError, ValueError) as err:
            self._log(f"seq {seq_id!r} drafts without its grammar: {err}")
            return None
        return _Copy(GrammarState(grammar, spec.stop_token_ids), spec.output_start)
