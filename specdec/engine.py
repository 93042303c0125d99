"""The speculative decoding loop: propose k drafts, verify them in one target pass, sample.

Leviathan et al. 2023 / Chen et al. 2023. ``SequenceState`` is the whole per-request
state machine and makes no model calls, so the same logic drives the in-process
loop (``specdec.generate``) and the step scheduler the server runs (``specdec.scheduler``). One step:

1. ``propose_request`` asks for ``k_eff = min(k, tokens left - 1)`` drafts, so that
   accepting every draft plus the bonus token never exceeds ``max_tokens``; it sends
   the proposer only the tokens it has not been sent (a step that drafts nothing
   sends nothing, and the next request carries what it missed);
2. ``verify_request`` feeds ``[last, d_1 .. d_k']`` at ``position = len(tokens) - 1``,
   which also cuts the target cache back past any drafts rejected last step;
3. the rejection sampler returns the accepted drafts plus a recovered or bonus token;
4. ``commit`` appends them, stopping at the first EOS / stop sequence / length limit.

The first step is the prefill: the whole prompt at position 0, no drafts.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from specdec.follow_acceptance import AcceptanceEstimate
from specdec.grammar import Grammar, GrammarState, cut_proposal, with_drafts_appended
from specdec.penalties import NO_PENALTIES, Penalties, emitted_log_probs
from specdec.sampling import derive_seed
from specdec.top_log_probs import MAX_TOP_LOG_PROBS, Alternatives, emitted_alternatives
from specdec.types import (
    GuideSpec, Proposal, ProposeRequest, RequestStats, SampleResult, SamplingParams, VerifyRequest, VerifyResult,
)  # fmt: skip

PROPOSE_STREAM = 0  # derive_seed stream of the proposer's draws in a step
SAMPLE_STREAM = 1  # derive_seed stream of the rejection sampler's draws in a step


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16  # output tokens at most, stop tokens included
    min_tokens: int = 0  # EOS / stop sequences end the output only after this many tokens
    num_speculative_tokens: int = 0  # k; 0 = plain autoregressive decoding through the same path
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()  # output includes the stop sequence
    penalties: Penalties = NO_PENALTIES  # applied to the target's distribution (specdec.penalties)
    return_log_probs: bool = False  # SequenceState.output_log_probs: the target's log probability of each token
    num_top_log_probs: int = 0  # with return_log_probs: each token's likeliest alternatives (top_log_probs)
    grammar: Grammar | None = None  # structured output: every token follows it (specdec.grammar)

    def validate(self, max_model_len: int | None = None, prompt_len: int = 0) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        self.sampling.validate()
        self.penalties.validate()
        if self.num_top_log_probs and not (self.return_log_probs and 0 < self.num_top_log_probs <= MAX_TOP_LOG_PROBS):
            raise ValueError(f"num_top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}] and needs return_log_probs, "
                             f"got {self.num_top_log_probs}")  # fmt: skip
        if self.grammar is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a grammar: the grammar decides where the output ends")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative token ids, got {self.eos_token_ids}")
        if any(len(s) == 0 or min(s) < 0 for s in self.stop_token_sequences):
            raise ValueError(
                f"stop_token_sequences must be non-empty sequences of non-negative ids, got {self.stop_token_sequences}"
            )
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
        if max_model_len is not None and prompt_len + self.max_tokens > max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds max_model_len={max_model_len}"
            )


@dataclass
class StepOutput:
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop sequence) | "length"
    stats: RequestStats | None = None  # the request's figures, on the finishing step only
    new_log_probs: list[float] = field(default_factory=list)  # of new_token_ids, when return_log_probs
    new_top_log_probs: list[Alternatives] = field(default_factory=list)  # theirs, when num_top_log_probs


class SequenceState:
    """Per-request decoding state; turns sampler results into emitted tokens."""

    def __init__(
        self, seq_id: str, prompt_ids: list[int], params: GenerationParams, hidden_layers: tuple[int, ...] = (),
        hidden_rows_stay: bool = False,
    ):
        """``hidden_layers``: the target hidden states a head proposer reads (``VerifyRequest.hidden_layers``).

        A request with ``num_speculative_tokens`` 0 never drafts, so it asks for none: the
        target's verify passes then cost what they cost without a head. ``hidden_rows_stay``:
        the head runs beside the target, which keeps the rows (``specdec.draft_beside_target``);
        the state then only counts them, and propose requests carry their position alone.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.output_log_probs: list[float] = []  # one per output token when params.return_log_probs
        self.output_top_log_probs: list[Alternatives] = []  # one per output token when params.num_top_log_probs
        self.finished = False
        self.finish_reason: str | None = None
        self.stats = RequestStats(accepted_per_position=[0] * params.num_speculative_tokens)
        self.acceptance = AcceptanceEstimate()  # what its drafts did, for a k that follows it: follow_acceptance
        seed = params.sampling.seed
        self._base_seed = seed if seed is not None else secrets.randbits(63)
        self._step = 0  # step 0 is the prefill
        self._num_sent_to_proposer = 0  # sequence length the proposer has been sent
        self.hidden_layers = tuple(hidden_layers) if params.num_speculative_tokens > 0 else ()
        self._hidden: list[torch.Tensor] = []  # verified rows not yet sent to the proposer, each [n, features]
        self._num_hidden_sent = 0  # positions whose hidden states the proposer has been sent
        self._hidden_rows_stay = hidden_rows_stay
        self._num_hidden_kept = 0  # rows kept, where they stay with the verifier
        self._accepted_path: tuple[int, ...] = ()  # the last step's accepted tree nodes, for the next verify
        single_token_stops = [s[0] for s in params.stop_token_sequences if len(s) == 1]
        # Banned while min_tokens is unmet, so they get probability 0 instead of being cut.
        self._banned_token_ids = tuple(dict.fromkeys([*params.eos_token_ids, *single_token_stops]))
        self.grammar = GrammarState(params.grammar, params.eos_token_ids) if params.grammar is not None else None
        self._guide_spec = None if params.grammar is None else GuideSpec(
            params.grammar.guide_type, params.grammar.guide, len(prompt_ids), tuple(params.eos_token_ids))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def _tokens_from(self, position: int) -> list[int]:
        """``token_ids[position:]`` without copying the whole sequence: a step sends only its new tokens."""
        past_prompt = position - len(self.prompt_ids)
        if past_prompt >= 0:
            return self.output_ids[past_prompt:]
        return self.prompt_ids[position:] + self.output_ids

    def num_draft_tokens(self) -> int:
        """k_eff for this step: drafts + one recovered/bonus token fit in the tokens left."""
        if self._step == 0:
            return 0
        return max(0, min(self.params.num_speculative_tokens, self.num_tokens_left() - 1))

    def num_tokens_left(self) -> int:
        """Output tokens the request may still emit (``max_tokens`` less those emitted)."""
        return self.params.max_tokens - len(self.output_ids)

    def num_unsent_to_proposer(self) -> int:
        """Tokens the next propose request carries: the prompt at first, then what the steps since added."""
        return len(self.prompt_ids) + len(self.output_ids) - self._num_sent_to_proposer

    def propose_request(self, max_drafts: int | None = None, guided: bool = False) -> ProposeRequest | None:
        """This step's drafts to ask for, at most ``max_drafts`` (a length policy's choice) if given.

        Carries the tokens the proposer has not been sent, from ``position`` on, and counts
        them as sent: the proposer keeps the sequence, so none is sent twice. ``guided``: the
        proposer runs in this process, and drafts under the request's grammar if it has one.
        """
        self._check_running()
        k = self.num_draft_tokens() if max_drafts is None else min(self.num_draft_tokens(), max_drafts)
        if k <= 0:
            return None
        banned = self._num_banned(k)  # draft i becomes output index len(output_ids) + i
        position = self._num_sent_to_proposer
        self._num_sent_to_proposer = len(self.prompt_ids) + len(self.output_ids)
        hidden_position, hidden = self._num_hidden_sent, None
        if self._hidden_rows_stay:
            self._num_hidden_sent = self._num_hidden_kept
        elif self._hidden:
            hidden = torch.cat(self._hidden) if len(self._hidden) > 1 else self._hidden[0]  # [n, features]
            self._hidden, self._num_hidden_sent = [], hidden_position + hidden.shape[0]
        return ProposeRequest(
            seq_id=self.seq_id,
            position=position,
            token_ids=self._tokens_from(position),
            num_tokens=k,
            sampling=self.params.sampling,
            seed=derive_seed(self._base_seed, self._step, PROPOSE_STREAM),
            num_banned_tokens=banned,
            banned_token_ids=self._banned_token_ids if banned else (),
            hidden_states=hidden,
            hidden_position=hidden_position,
            guide=self.grammar if guided else None,
            guide_spec=self._guide_spec if position == 0 else None,  # the sequence's first, or its proposer lost it
        )

    def constrain(self, proposal: Proposal | None, max_drafts: int = 0) -> Proposal | None:
        """``proposal`` cut where the grammar forbids a draft (it could only be rejected: ``specdec.grammar``),
        then a chain extended by the tokens the grammar forces, up to ``max_drafts`` drafts in all (the
        ``num_tokens`` of the step's propose request; 0 when it made none).

        With a grammar, call it on every proposal before ``verify_request``, and pass what it
        returns on to the sampler and ``commit``.
        """
        if self.grammar is None:
            return proposal
        if proposal is not None and len(proposal.token_ids):
            drafts = proposal.token_ids.tolist()
            sampled_q = proposal.probs is not None or proposal.probs_held  # its forbidden draft stays, to be rejected
            kept = self.grammar.allowed_drafts(drafts, proposal.parents, sampled_q)
            if sampled_q and len(kept) < len(drafts):
                return cut_proposal(proposal, kept)  # ends at a forbidden draft, or is a tree: nothing after it
            proposal = cut_proposal(proposal, kept)
        if proposal is not None and (proposal.parents is not None or proposal.probs_held):
            return proposal  # a tree, or a q held elsewhere: nothing is appended
        drafts = [] if proposal is None else proposal.token_ids.tolist()  # the kept ones
        forced = self.grammar.forced_after(drafts, max_drafts - len(drafts)) if max_drafts > len(drafts) else []
        return proposal if not forced else with_drafts_appended(proposal, forced)

    def verify_request(self, proposal: Proposal | None, drafted_there: bool = False) -> VerifyRequest:
        """``drafted_there``: ``proposal`` holds placeholders for drafts the verify call makes (beside the
        target), so a grammar's mask is row 0's alone; the call masks the rows after its drafts."""
        self._check_running()
        drafts = self._draft_ids(proposal)
        parents = proposal.parents if proposal is not None and drafts else None
        num_logits = len(drafts) + 1
        banned_rows = self._num_banned(num_logits)  # row i predicts output index len(output_ids) + i
        masks = None if self.grammar is None else self.grammar.masks([] if drafted_there else drafts, parents)
        if self._step == 0:
            position, token_ids = 0, self.prompt_ids
        else:
            position, token_ids = len(self.prompt_ids) + len(self.output_ids) - 1, [self.output_ids[-1], *drafts]
        return VerifyRequest(
            seq_id=self.seq_id,
            position=position,
            token_ids=token_ids,
            num_logits=num_logits,
            sampling=self.params.sampling,
            num_banned_rows=banned_rows,
            banned_token_ids=self._banned_token_ids if banned_rows else (),
            penalties=self.params.penalties,
            num_prompt_tokens=len(self.prompt_ids),
            log_probs=self.params.return_log_probs,
            num_top_log_probs=self.params.num_top_log_probs,
            hidden_layers=self.hidden_layers,
            tree_parents=parents,
            accepted_path=self._accepted_path,
            allowed_tokens=masks,
        )

    def _num_banned(self, num_positions: int) -> int:
        """Of the next ``num_positions`` output indices, how many lie below ``min_tokens`` (and cannot stop)."""
        if not self._banned_token_ids:
            return 0
        return min(num_positions, max(0, self.params.min_tokens - len(self.output_ids)))

    def sample_seed(self) -> int:
        """The request's sampling seed: with ``sample_position`` it keys the draws of every output position."""
        return derive_seed(self._base_seed, 0, SAMPLE_STREAM)

    def sample_position(self) -> int:
        """The output index of the step's first verified row; row i emits output index ``position + i``."""
        return len(self.output_ids)

    def commit(
        self, proposal: Proposal | None, result: SampleResult, verified: VerifyResult | None = None
    ) -> StepOutput:
        """Append the sampler's tokens up to the first stop; ``verified`` (this step's verify result) gives
        their log probs, and its hidden states are kept for the accepted rows."""
        self._check_running()
        num_drafts = len(self._draft_ids(proposal))
        tokens = result.output_token_ids.tolist()
        if not 0 <= result.num_accepted <= num_drafts or len(tokens) != result.num_accepted + 1:
            raise ValueError(
                f"seq {self.seq_id!r}: sampler returned {len(tokens)} tokens with num_accepted="
                f"{result.num_accepted} for {num_drafts} drafts"
            )
        kept = _kept_rows(proposal, result, num_drafts)  # the verified rows of tokens that stay, when a tree
        self._accepted_path = result.accepted_nodes if kept is not None else ()
        if self.hidden_layers and self._hidden_rows_stay:
            self._num_hidden_kept += self.num_fed(num_drafts) - (num_drafts - result.num_accepted)
        elif self.hidden_layers:
            self._keep_hidden(verified.hidden_states if verified is not None else None, num_drafts, result.num_accepted,
                              kept)  # fmt: skip
        if self._step > 0:
            self._record(num_drafts, result.num_accepted)
        self._step += 1
        new_token_ids: list[int] = []
        log_probs = self._log_probs(tokens, verified if kept is None else _rows_of(verified, kept), result)
        tops = emitted_alternatives(verified, len(tokens), kept) if self.params.num_top_log_probs else []
        for token in tokens:
            self.output_ids.append(token)
            new_token_ids.append(token)
            if self.grammar is not None:
                self.grammar.accept([token])
            self.finish_reason = self._finish_reason()
            if self.finish_reason is not None:
                self.finished = True
                break
        new_log_probs = log_probs[: len(new_token_ids)] if log_probs is not None else []
        self.output_log_probs += new_log_probs
        self.output_top_log_probs += tops[: len(new_token_ids)]
        return StepOutput(new_token_ids, self.finished, self.finish_reason, self.stats if self.finished else None,
                          new_log_probs, tops[: len(new_token_ids)])

    def _log_probs(self, tokens: list[int], verified: VerifyResult | None, result: SampleResult) -> list[float] | None:
        if not self.params.return_log_probs:
            return None
        if result.log_probs is not None:  # sampled where p is (SampleHere): worked out there
            if len(result.log_probs) != len(tokens):
                raise ValueError(f"seq {self.seq_id!r}: {len(result.log_probs)} log probs for {len(tokens)} tokens")
            return list(result.log_probs)
        if verified is None or verified.log_mass is None:
            raise ValueError(f"seq {self.seq_id!r}: return_log_probs needs the verifier's log_mass, got none")
        return emitted_log_probs(tokens, verified.log_mass, verified.probs, verified.argmax)

    def _keep_hidden(self, hidden_states: torch.Tensor | None, num_drafts: int, num_accepted: int,
                     kept: list[int] | None = None) -> None:  # fmt: skip
        """The rows of the tokens that stay in the sequence (all but the rejected drafts', or a tree's ``kept``
        rows: the root's and its accepted path's) await the proposer."""
        if hidden_states is None:
            raise ValueError(
                f"seq {self.seq_id!r}: the verify result carries no hidden states, but the proposer reads "
                f"layers {self.hidden_layers}"
            )
        fed = self.num_fed(num_drafts)
        if hidden_states.shape[0] != fed:
            raise ValueError(
                f"seq {self.seq_id!r}: {hidden_states.shape[0]} hidden-state rows for {fed} tokens verified"
            )
        if kept is not None:
            self._hidden.append(hidden_states[kept])  # [1 + num_accepted, features]
            return
        self._hidden.append(hidden_states[: fed - (num_drafts - num_accepted)])  # [kept, features]

    def num_fed(self, num_drafts: int) -> int:
        """Tokens this step's verify feeds with ``num_drafts`` drafts: the prompt, or [last, d1 .. dk']."""
        return len(self.prompt_ids) if self._step == 0 else 1 + num_drafts

    def _record(self, num_drafts: int, num_accepted: int) -> None:
        self.stats.num_steps += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        self.acceptance = self.acceptance.after(num_drafts, num_accepted)
        for i in range(num_accepted):
            self.stats.accepted_per_position[i] += 1

    def _finish_reason(self) -> str | None:
        """Checked after each appended token; the token at output index i may stop only if i >= min_tokens."""
        out = self.output_ids
        if self.grammar is not None and self.grammar.terminated:
            return "stop"
        if len(out) > self.params.min_tokens:
            if out[-1] in self.params.eos_token_ids:
                return "stop"
            for stop in self.params.stop_token_sequences:
                if len(out) >= len(stop) and tuple(out[-len(stop) :]) == stop:
                    return "stop"
        return "length" if len(out) >= self.params.max_tokens else None

    def _draft_ids(self, proposal: Proposal | None) -> list[int]:
        drafts = [] if proposal is None else proposal.token_ids.tolist()
        if len(drafts) > self.num_draft_tokens():
            raise ValueError(
                f"seq {self.seq_id!r}: proposal has {len(drafts)} tokens, more than the "
                f"{self.num_draft_tokens()} requested"
            )
        return drafts

    def _check_running(self) -> None:
        if self.finished:
            raise RuntimeError(f"seq {self.seq_id!r} has already finished ({self.finish_reason})")


def _kept_rows(proposal: Proposal | None, result: SampleResult, num_drafts: int) -> list[int] | None:
    """A tree step's verified rows whose tokens stay (the root's, then its accepted nodes'); None for a chain."""
    if proposal is None or proposal.parents is None or not num_drafts:
        return None
    if result.accepted_nodes is None or len(result.accepted_nodes) != result.num_accepted:
        raise ValueError(f"a tree of {num_drafts} drafts was judged without its accepted path: {result.accepted_nodes}")
    return [0, *(node + 1 for node in result.accepted_nodes)]


def _rows_of(verified: VerifyResult | None, rows: list[int]) -> VerifyResult | None:
    """The verify result of the rows on a tree's accepted path, for the log probs of the tokens emitted there."""
    if verified is None or verified.log_mass is None:
        return verified
    pick = torch.tensor(rows, device=verified.argmax.device)
    return VerifyResult(verified.argmax[pick], None if verified.probs is None else verified.probs[pick],
                        verified.log_mass[pick])  # fmt: skip
