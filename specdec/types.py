"""Data that crosses a stage boundary: proposer -> verifier -> rejection sampler -> engine.

Vocabulary used across the package (after vLLM and Leviathan et al. 2023):

* ``p``  -- the target model's processed distribution (temperature, top-k, top-p applied).
* ``q``  -- the draft proposer's distribution for the tokens it proposed.
* *draft* tokens are proposed; *accepted* tokens are drafts the sampler kept;
  a *recovered* token replaces the first rejected draft; a *bonus* token is drawn
  from ``p`` at position ``k + 1`` when all ``k`` drafts are accepted.

Every call is addressed by ``seq_id`` and, where it touches a KV cache, by
``position``: the index in the sequence of the first token passed in. Components
own the caches; a call at ``position`` n discards whatever the cache held past n.
All calls take a list of requests, so a batched engine can serve them in one pass.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from specdec.penalties import NO_PENALTIES, Penalties

PLACEHOLDER_TOKEN_ID = -1  # pads ragged token lists in batched tensors
# Temperatures below this decode greedily (vLLM's _SAMPLING_EPS): logits / T overflows to inf
# long before T reaches 0, and such a distribution is the argmax anyway.
GREEDY_TEMPERATURE_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the logits; a temperature under ``GREEDY_TEMPERATURE_BELOW`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    seed: int | None = None  # per-request seed; None draws one at random
    min_p: float = 0.0  # drop tokens below min_p x the likeliest's probability (after temperature); 0 disables
    # (token id, bias) pairs added to the logits before anything else (OpenAI's logit_bias): a change of the
    # target's distribution, applied to p by the verifier and to q by the drafters (specdec.sampling)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_BELOW or self.top_k == 1

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        check_logit_bias(self.logit_bias)


def check_logit_bias(logit_bias: tuple[tuple[int, float], ...], vocab_size: int | None = None) -> None:
    """Each token once, a non-negative id (below ``vocab_size`` when given), a bias that is a number or -inf (a ban)."""
    ids = [token for token, _ in logit_bias]
    if len(set(ids)) != len(ids):
        raise ValueError(f"logit_bias names a token twice: {sorted(t for t in set(ids) if ids.count(t) > 1)}")
    for token, bias in logit_bias:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ValueError(f"logit_bias token {token} is not a token id in [0, {vocab_size or 'vocab_size'})")
        if math.isnan(bias) or bias == math.inf:
            raise ValueError(f"logit_bias of token {token} must be a number (or -inf: a ban), got {bias}")


@dataclass(frozen=True)
class ProposeRequest:
    """Ask for k drafts; like a ``VerifyRequest``, it carries only what the proposer has not been sent.

    The caller (``SequenceState``) keeps how much of the sequence it has sent; the
    proposer keeps the tokens (and, for a draft model, the KV cache) and discards
    whatever it held past ``position``, so a rejected draft or a skipped step costs
    no whole-sequence comparison.
    """

    seq_id: str
    position: int  # sequence index of token_ids[0]; the proposer drops what it held past it
    token_ids: list[int]  # the tokens the proposer has not been sent yet (prompt, then accepted output)
    num_tokens: int  # k: how many tokens to propose (may be 0)
    sampling: SamplingParams
    seed: int  # seed for this call's draws (derived per step by the engine)
    # min_tokens: the first `num_banned_tokens` drafts may not be any of `banned_token_ids`,
    # which the target cannot emit there either (a banned draft could only be rejected)
    num_banned_tokens: int = 0
    banned_token_ids: tuple[int, ...] = ()
    # Heads that read the target's features (EAGLE-3, MLP speculator): the target's hidden
    # states at positions hidden_position .. hidden_position + n - 1 that the proposer has not
    # been sent, one row per verified token; None for proposers that need none.
    hidden_states: torch.Tensor | None = None  # [n, num_layers * hidden]
    hidden_position: int = 0
    # structured output: what the drafts may be (the request's grammar), set only where the proposer
    # runs in the grammar's process (StepCapabilities.drafts_under_grammar); None: draft freely
    guide: DraftGuide | None = None
    # structured output, for a proposer in another process: the request's guide, sent with the
    # sequence's first request (position 0), which that process compiles and follows itself
    # (specdec.guided_drafts); None on every later request, and without a grammar
    guide_spec: GuideSpec | None = None


@dataclass(frozen=True)
class GuideSpec:
    """A request's grammar as text (``specdec.grammar``), for a drafter in another process to compile."""

    guide_type: str  # specdec.grammar.GUIDE_TYPES
    guide: str
    output_start: int  # sequence index of the first output token: the grammar starts there
    stop_token_ids: tuple[int, ...]  # the request's EOS ids, the matcher's stop tokens (empty: the tokenizer's)


class DraftGuide(Protocol):
    """What a drafter may draft next: a request's grammar (``specdec.grammar.GrammarState``)."""

    def allowed_after(self, drafts: Sequence[int]) -> torch.Tensor | None:
        """``[1, ceil(vocab / 32)]`` int32 bitmask of the tokens allowed after ``drafts``; None: any."""
        ...


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [k'] int64, k' <= k (0 when there is nothing to propose)
    probs: torch.Tensor | None = None  # [k', vocab] q; None -> one-hot q (e.g. n-gram), unless held
    # q did not come back: it waits where the rejection sampler reads it (served, the
    # proposer hands it to rejection_sampler itself), so it crosses one process boundary
    probs_held: bool = False
    # which of several proposers drafted it, where one step may take either (suffix decoding in
    # front of a model: "suffix" or "model", specdec.suffix_first); None where one proposer drafts
    source: str | None = None
    # a tree (specdec.tree): each draft's parent among the drafts, ROOT (-1) for a child of the
    # sequence's last token; breadth-first, so parents come first. None: a chain
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SampleHere:
    """Rejection-sample this sequence where ``p`` is made: the verifier hands ``p`` to the sampler.

    ``p`` is ``[k + 1, vocab]``; sent back to the caller and on to the sampler it would
    cross two process boundaries every step, and only ``k + 2`` numbers of the result
    matter to the caller.
    """

    seed: int  # the request's sampling seed (SequenceState.sample_seed)
    draft_probs_held: bool = False  # q waits in the sampler (Proposal.probs_held); else one-hot at the drafts
    position: int | None = None  # output index of row 0 (SequenceState.sample_position): keys each row's draws


@dataclass(frozen=True)
class VerifyRequest:
    seq_id: str
    position: int  # sequence index of token_ids[0]; the cache is cut back to this length
    token_ids: list[int]  # tokens not yet in the target's cache: accepted tokens + drafts
    num_logits: int  # k + 1: distributions wanted for the last num_logits positions
    sampling: SamplingParams
    # Rows (from the first of the num_logits rows) in which `banned_token_ids` get
    # probability 0: how min_tokens suppresses EOS and stop tokens losslessly.
    num_banned_rows: int = 0
    banned_token_ids: tuple[int, ...] = ()
    # Penalties apply to every row with the tokens before it (``specdec.penalties``); the
    # verifier keeps the sequence's tokens for them, and counts output tokens from
    # num_prompt_tokens on.
    penalties: Penalties = NO_PENALTIES
    num_prompt_tokens: int = 0
    log_probs: bool = False  # also return log_mass, for the emitted tokens' log probabilities
    # with log_probs: also return each row's likeliest tokens and their log probabilities (top_log_probs)
    num_top_log_probs: int = 0
    # Hidden states to return for every token fed, concatenated in this order; indices into
    # transformers' ``output_hidden_states`` tuple: i < num_layers is the input of layer i
    # (0: the embeddings), num_layers the final normed state. Empty: none.
    hidden_layers: tuple[int, ...] = ()
    # set: the drafts are token_ids[-(num_logits - 1):]; the result carries the sampler's
    # verdict (VerifyResult.sampled) instead of p
    sample_here: SampleHere | None = None
    # the drafts (token_ids[1:]) form a tree (Proposal.parents): each attends to its ancestors alone
    tree_parents: tuple[int, ...] | None = None
    # the previous step fed a tree and accepted these nodes (indices into its drafts, root first):
    # their cached keys and values move down to the positions of their depths before this call runs
    accepted_path: tuple[int, ...] = ()
    # structured output (specdec.grammar): bit b of word w allows token 32 w + b in that row; every
    # row's other tokens get probability 0, before argmax and p. None: no grammar
    allowed_tokens: torch.Tensor | None = None  # [num_logits, ceil(vocab / 32)] int32


@dataclass
class SampleResult:
    output_token_ids: torch.Tensor  # [num_accepted + 1] int64: accepted + recovered/bonus
    num_accepted: int
    # the target's log probability of each output token, when asked (VerifyRequest.log_probs)
    # and sampled where p is: p does not travel, so they are worked out there
    log_probs: list[float] | None = None
    # a tree's accepted path: node indices into its drafts, root's child first; None for a chain
    accepted_nodes: tuple[int, ...] | None = None


@dataclass
class VerifyResult:
    argmax: torch.Tensor  # [num_logits] int64: the target's greedy token at each position
    probs: torch.Tensor | None = None  # [num_logits, vocab] float32 p; None when greedy or sampled here
    log_mass: torch.Tensor | None = None  # [num_logits] float32 (penalties.log_kept_mass); None unless asked
    # [len(token_ids), len(hidden_layers) * hidden], when any sequence of the call asked for hidden_layers; else None
    hidden_states: torch.Tensor | None = None
    sampled: SampleResult | None = None  # the sampler's verdict, for a request with sample_here
    # each row's num_top_log_probs likeliest tokens, when asked (specdec.top_log_probs)
    top_token_ids: torch.Tensor | None = None  # [num_logits, n] int64
    top_log_probs: torch.Tensor | None = None  # [num_logits, n] float32


@dataclass(frozen=True)
class SampleCall:
    """One sequence's rejection-sampling input: its drafts, ``q``, the target's result and a seed."""

    draft_token_ids: torch.Tensor  # [k] int64
    draft_probs: torch.Tensor | None  # [k, vocab] q; None -> one-hot q at the drafts
    verify: VerifyResult  # argmax [k + 1]; probs [k + 1, vocab] p or None (greedy)
    seed: int | None  # None -> a fresh random seed
    method: str | None = None  # overrides the sampler's configured method
    # output index of row 0: row i draws from (seed, position + i), so an output position's
    # draws do not depend on the step that reaches it; None: every row from the one seed
    position: int | None = None
    parents: tuple[int, ...] | None = None  # the drafts form a tree (Proposal.parents)

    def to(self, device: str | torch.device) -> SampleCall:
        probs = self.verify.probs
        return replace(
            self,
            draft_token_ids=self.draft_token_ids.to(device),
            draft_probs=None if self.draft_probs is None else self.draft_probs.to(device),
            verify=VerifyResult(self.verify.argmax.to(device), None if probs is None else probs.to(device)),
        )


@dataclass(frozen=True)
class ModelDescription:
    """What a served model is, told once at load instead of on every data response.

    The orchestrator checks requests against the limits and the draft against the
    target (``check_draft_compatible``) before the first step.
    """

    model: str  # the checkpoint directory's resolved path; "ngram" for prompt lookup; "" for the sampler
    vocab_size: int | None  # width of p or q; None: no vocabulary (n-gram, sampler)
    max_model_len: int | None  # tokens a sequence may hold; None: unbounded
    max_num_seqs: int | None  # sequences held at once; None: unbounded
    method: str  # "target", "draft_model", "ngram", "eagle3", "mlp_speculator", or the sampler's method
    # a head's: the target hidden states it reads (VerifyRequest.hidden_layers); () for the others
    hidden_state_layers: tuple[int, ...] = ()
    # a model-free proposer's settings (n-gram, suffix; specdec.proposers.model_free): with them
    # the orchestrator runs the proposer in its own process; () for everything that runs a model
    settings: tuple[tuple[str, int | float], ...] = ()


@dataclass
class RequestStats:
    """Per-request acceptance figures, cumulative over the request."""

    num_steps: int = 0  # speculative steps (prefill excluded)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] counts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step (accepted + 1), the speedup numerator."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0


@dataclass(frozen=True)
class StepCapabilities:
    """What a :class:`specdec.scheduler.Stages` implementation does inside its calls, declared once by it.

    The scheduler plans each step from these and nothing else; a wrapper that adds a
    proposer in front of other stages declares what it wraps.
    """

    # verify rejection-samples every request that carries ``sample_here`` where ``p`` is
    # made, and returns the verdict as ``VerifyResult.sampled``; ``sample`` is never called
    samples_in_verify: bool = False
    # a step is one ``propose_and_verify`` call (the drafter runs with the target:
    # ``specdec.draft_beside_target``); ``propose`` and ``verify`` are never called
    proposes_in_verify: bool = False
    # propose runs in the scheduler's process, so each request can carry its grammar
    # (``ProposeRequest.guide``) and a model drafter masks its ``q`` by it (``specdec.grammar``)
    drafts_under_grammar: bool = False
