"""Rejection sampling: decide which draft tokens the target keeps, and what it emits next.

Vocabulary (as in :mod:`specdec.types`): ``p`` is the target's processed distribution,
``q`` the draft's. Of ``k`` draft tokens the sampler *accepts* a prefix; at the first
rejected position it emits a *recovered* token; when all ``k`` are accepted it emits a
*bonus* token from ``p`` at position ``k + 1``. Every call emits ``num_accepted + 1``
tokens.

Methods:

* ``probabilistic`` -- speculative sampling (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling"): accept draft ``x`` with probability
  ``min(1, p(x) / q(x))``, recover from ``normalize(max(0, p - q))`` (from ``p`` if that
  residual is all zero). Each emitted token is distributed exactly as ``p``, whatever ``q`` is.
* ``strict`` -- the target draws its own token at every position and keeps drafts while
  they equal it. Equally lossless and needs no ``q``, but accepts less often when
  sampling (it is the same as ``probabilistic`` when the target is greedy). Against a
  one-hot ``q`` (n-gram, suffix decoding) it accepts a draft ``x`` with probability
  ``p(x)``, as ``probabilistic`` does, so ``probabilistic`` runs as ``strict`` there
  (:func:`effective_method`): the tokens emitted are then the target's own draws.
* ``synthetic`` -- a benchmarking mode after vLLM's: each position is accepted with
  probability ``synthetic_acceptance_rate`` whatever the tokens are, then the target's
  own token is emitted. NOT lossless: it fixes the acceptance pattern so that speed can
  be measured independently of how well the draft matches.

Randomness is drawn once per call by :func:`draw_randoms`, or, for a served or engine
request, by :func:`draw_randoms_by_position`: each row from a generator keyed by the
request's seed and the row's output position, so a position's draws do not depend on
which step reaches it. With ``strict`` (and a one-hot ``q``) a seeded request then emits
the same tokens whatever was drafted, at any ``k`` and batch (given the same ``p``). A
row drawn in a step that rejected earlier is drawn again, with the same numbers, in the
next step: lossless, since no token emitted before it depended on them. The torch path
here (:func:`rejection_sample_batch`, vectorized over requests) and the Triton kernel in
:mod:`specdec.kernels.rejection` consume the same draws with the same float32
operations, so the two agree token for token. A categorical draw from
weights ``w`` is the exponential race ``argmax_i w_i / E_i`` with ``E_i ~ Exp(1)``
(equivalent to the Gumbel-max trick); the draws store ``1 / E`` so that both paths only
multiply, which rounds identically everywhere.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import derive_seed, make_generator
from specdec.tree_sampler import sample_tree
from specdec.types import PLACEHOLDER_TOKEN_ID, SampleResult, VerifyResult

METHODS = ("strict", "probabilistic", "synthetic")

# rejection_sample_batch, or the Triton kernel's drop-in replacement for it.
BatchSampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SamplerRandoms:
    """Every random number one batched sampling call consumes."""

    uniforms: torch.Tensor  # [batch, k] U[0, 1): one acceptance test per draft position
    inv_exponentials: torch.Tensor | None  # [batch, k + 1, vocab] 1 / Exp(1); None: no categorical draws


def draw_randoms(
    batch: int,
    num_draft_tokens: int,
    vocab: int,
    generator: torch.Generator,
    categorical: bool = True,
    device: torch.device | str | None = None,
) -> SamplerRandoms:
    """Draw on ``generator``'s device (so a seed means the same draws there), then move to ``device``.

    ``categorical=False`` skips the ``[batch, k + 1, vocab]`` noise when nothing is sampled
    from ``p`` (greedy targets).
    """
    uniforms = torch.rand(batch, num_draft_tokens, generator=generator, device=generator.device)
    inv_exponentials = None
    if categorical:
        exponentials = torch.empty(batch, num_draft_tokens + 1, vocab, device=generator.device)
        exponentials.exponential_(generator=generator)
        # Exp(1) draws can be exactly 0; the floor keeps 1 / E finite and w / E <= 1 / tiny.
        inv_exponentials = exponentials.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()
    if device is not None:
        uniforms = uniforms.to(device)
        inv_exponentials = None if inv_exponentials is None else inv_exponentials.to(device)
    return SamplerRandoms(uniforms=uniforms, inv_exponentials=inv_exponentials)


def draw_randoms_by_position(
    seed: int,
    position: int,  # output index of row 0
    num_draft_tokens: int,
    vocab: int,
    categorical: bool = True,
    device: torch.device | str = "cpu",
) -> SamplerRandoms:
    """:class:`SamplerRandoms` for one request whose row i draws from ``(seed, position + i)`` alone.

    Every row draws its uniform, then its exponentials, the bonus row too (its uniform
    unused), so an output position gets the same numbers as a draft row or as the bonus.
    """
    uniforms, exponentials = [], []
    for row in range(num_draft_tokens + 1):
        generator = make_generator(derive_seed(seed, position + row, 0), device)
        uniforms.append(torch.rand(1, generator=generator, device=generator.device))  # [1]
        if categorical:
            exponentials.append(torch.empty(vocab, device=generator.device).exponential_(generator=generator))
    inv_exponentials = None
    if categorical:
        stacked = torch.stack(exponentials).unsqueeze(0)  # [1, k + 1, vocab]
        inv_exponentials = stacked.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()
    drafts = torch.cat(uniforms[:num_draft_tokens]) if num_draft_tokens else torch.empty(0, device=device)  # [k]
    return SamplerRandoms(uniforms=drafts.view(1, num_draft_tokens), inv_exponentials=inv_exponentials)


def _draws_from(generator: torch.Generator) -> Callable[..., SamplerRandoms]:
    """``(k, vocab, categorical, device) -> SamplerRandoms`` for one request, from ``generator``."""
    return lambda k, vocab, categorical, on: draw_randoms(1, k, vocab, generator, categorical, on)


def _draws(seed: int, position: int | None, device: torch.device | str) -> Callable[..., SamplerRandoms]:
    """As ``_draws_from``: keyed by output position, or from one generator seeded for the call."""
    if position is not None:
        return lambda k, vocab, categorical, on: draw_randoms_by_position(seed, position, k, vocab, categorical, on)
    return _draws_from(make_generator(seed, device))


def validate_method(method: str, synthetic_acceptance_rate: float) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 0.0 <= synthetic_acceptance_rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {synthetic_acceptance_rate}")


def effective_method(method: str, greedy_target: bool, one_hot_draft: bool = False) -> str:
    """A greedy target (no ``p``) turns every lossless method into strict matching on its argmax;
    against a one-hot ``q`` probabilistic and strict accept alike, and strict emits the target's own draws."""
    if method == "synthetic":
        return method
    return "strict" if greedy_target or (one_hot_draft and method == "probabilistic") else method


def rejection_sample_batch(
    draft_token_ids: torch.Tensor,  # [batch, k] int64, ids in [0, vocab), PLACEHOLDER_TOKEN_ID past a row's drafts
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] q; None -> one-hot q at the drafts
    target_probs: torch.Tensor | None,  # [batch, k + 1, vocab] p; None -> greedy target
    target_argmax: torch.Tensor | None,  # [batch, k + 1] int64; used when target_probs is None
    method: str,
    randoms: SamplerRandoms,
    synthetic_acceptance_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, k + 1] int64 padded with PLACEHOLDER_TOKEN_ID, [batch] int64
    """Vectorized rejection sampling of many independent requests with the same ``k``.

    Returns the emitted tokens (``num_accepted + 1`` per row, then placeholders) and the
    number of accepted drafts per row. A row with fewer drafts pads them with
    ``PLACEHOLDER_TOKEN_ID``: a placeholder is never accepted, and where a row's drafts
    end its next token is the bonus, drawn from ``p`` (there is no draft to recover from).
    """
    batch, k = draft_token_ids.shape
    method = effective_method(method, target_probs is None, draft_probs is None)
    if target_probs is not None:
        p = target_probs.float()  # [batch, k + 1, vocab]
        # The target's own draw at every position; also the bonus and the fallback.
        target_tokens = (p * randoms.inv_exponentials).argmax(dim=-1)  # [batch, k + 1]
    else:
        target_tokens = target_argmax.long()
    draft = draft_token_ids.long()
    is_draft = draft != PLACEHOLDER_TOKEN_ID  # [batch, k]
    safe_draft = draft.clamp_min(0)  # [batch, k]: a placeholder reads id 0, then counts as rejected

    if method == "strict":
        accepted = draft == target_tokens[:, :k]  # [batch, k]
    elif method == "synthetic":
        rate = torch.tensor(synthetic_acceptance_rate, dtype=torch.float32, device=draft.device)
        accepted = randoms.uniforms < rate  # [batch, k]
    else:
        q = _draft_probs_or_one_hot(draft_probs, safe_draft, p.shape[-1])  # [batch, k, vocab]
        p_draft = p[:, :k].gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1)  # [batch, k] p(x)
        q_draft = q.gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1)  # [batch, k] q(x)
        # u < p(x) / q(x) without dividing; q(x) = 0 accepts exactly when p(x) > 0.
        accepted = randoms.uniforms * q_draft < p_draft  # [batch, k]
    accepted = accepted & is_draft

    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [batch]
    # Target token at the first non-accepted position, or the bonus at position k.
    final = target_tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    if method == "probabilistic" and k > 0:
        residual_keys = (p[:, :k] - q).clamp_min(0.0) * randoms.inv_exponentials[:, :k]  # [batch, k, vocab]
        # An all-zero residual (only possible through rounding or unnormalized q) falls back to p.
        recovered = torch.where(
            residual_keys.amax(dim=-1) > 0, residual_keys.argmax(dim=-1), target_tokens[:, :k]
        )  # [batch, k]
        row = num_accepted.clamp(max=k - 1).unsqueeze(1)  # [batch, 1]
        rejected_a_draft = (num_accepted < k) & is_draft.gather(1, row).squeeze(1)  # [batch]; else: the bonus
        final = torch.where(rejected_a_draft, recovered.gather(1, row).squeeze(1), final)

    positions = torch.arange(k + 1, device=draft.device)  # [k + 1]
    placeholder = torch.full((batch, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=draft.device)
    padded_draft = torch.cat([draft, placeholder], dim=1)  # [batch, k + 1]
    output = torch.where(positions < num_accepted.unsqueeze(1), padded_draft, PLACEHOLDER_TOKEN_ID)
    output.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return output, num_accepted


def match_greedy(
    draft_token_ids: Sequence[int],  # [k]
    target_argmax: Sequence[int],  # [k + 1]
) -> SampleResult:
    """Rejection sampling against a greedy target, in plain Python.

    With no ``p`` every lossless method is strict matching (:func:`effective_method`):
    drafts are kept while they equal the target's argmax, and the argmax at the first
    mismatch (or the bonus at position ``k``) follows. It draws nothing, so it equals
    :func:`rejection_sample` for any seed; for ``k`` integer comparisons a tensor round
    trip would cost more than the work.
    """
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError(f"target_argmax must hold k + 1 = {len(draft_token_ids) + 1} ids, got {len(target_argmax)}")
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_argmax):
        if draft != target:
            break
        num_accepted += 1
    output = torch.tensor(list(target_argmax[: num_accepted + 1]), dtype=torch.long)  # [num_accepted + 1]
    return SampleResult(output_token_ids=output, num_accepted=num_accepted)


def _draft_probs_or_one_hot(
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None
    draft: torch.Tensor,  # [batch, k]
    vocab: int,
) -> torch.Tensor:  # [batch, k, vocab] float32
    if draft_probs is not None:
        return draft_probs.float()
    one_hot = torch.zeros(*draft.shape, vocab, device=draft.device)
    return one_hot.scatter_(-1, draft.unsqueeze(-1), 1.0)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [k] int64, k >= 0
    draft_probs: torch.Tensor | None,  # [k, vocab] q, None -> one-hot q at the draft ids
    target_probs: torch.Tensor | None,  # [k + 1, vocab] p, None -> greedy (use target_argmax)
    target_argmax: torch.Tensor | None,  # [k + 1] int64, required when target_probs is None
    method: str,
    generator: torch.Generator,
    synthetic_acceptance_rate: float = 0.0,
) -> SampleResult:
    """Sample one request with the torch path; see the module docstring for the methods."""
    return _sample_one(
        rejection_sample_batch, draft_token_ids, draft_probs, target_probs, target_argmax,
        method, _draws_from(generator), synthetic_acceptance_rate,
    )


def _sample_one(
    batch_sampler: BatchSampler,
    draft_token_ids: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab]
    target_probs: torch.Tensor | None,  # [k + 1, vocab]
    target_argmax: torch.Tensor | None,  # [k + 1]
    method: str,
    draw: Callable[[int, int, bool, torch.device], SamplerRandoms],  # (k, vocab, categorical, device)
    synthetic_acceptance_rate: float,
) -> SampleResult:
    validate_method(method, synthetic_acceptance_rate)
    _validate_shapes(draft_token_ids, draft_probs, target_probs, target_argmax)
    k = draft_token_ids.shape[0]
    device = draft_token_ids.device if target_probs is None else target_probs.device
    vocab = 0 if target_probs is None else target_probs.shape[-1]
    randoms = draw(k, vocab, target_probs is not None, device)
    output, num_accepted = batch_sampler(
        draft_token_ids.to(device).unsqueeze(0),
        None if draft_probs is None else draft_probs.to(device).unsqueeze(0),
        None if target_probs is None else target_probs.unsqueeze(0),
        None if target_argmax is None else target_argmax.to(device).unsqueeze(0),
        method,
        randoms,
        synthetic_acceptance_rate,
    )
    n = int(num_accepted[0])
    return SampleResult(output_token_ids=output[0, : n + 1], num_accepted=n)


def _validate_shapes(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor | None,
) -> None:
    if draft_token_ids.dim() != 1:
        raise ValueError(f"draft_token_ids must be 1-D [k], got shape {tuple(draft_token_ids.shape)}")
    k = draft_token_ids.shape[0]
    if target_probs is None:
        if target_argmax is None:
            raise ValueError("target_argmax is required when target_probs is None")
        if tuple(target_argmax.shape) != (k + 1,):
            raise ValueError(f"target_argmax must have shape [{k + 1}], got {tuple(target_argmax.shape)}")
        vocab = None
    else:
        if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
            raise ValueError(f"target_probs must have shape [{k + 1}, vocab], got {tuple(target_probs.shape)}")
        vocab = target_probs.shape[1]
    if draft_probs is not None and vocab is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must have shape [{k}, {vocab}], got {tuple(draft_probs.shape)}")
    if k and (int(draft_token_ids.min()) < 0 or (vocab is not None and int(draft_token_ids.max()) >= vocab)):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab or 'vocab'}), got {draft_token_ids.tolist()}")
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is not None and probs.numel():
            _validate_distribution(name, probs)


def _validate_distribution(name: str, probs: torch.Tensor) -> None:  # probs: [rows, vocab]
    """Each row must be a distribution: finite, non-negative, with positive mass.

    A NaN or all-zero row would otherwise draw token 0 (often EOS) and end the output
    with no error: output that is silently wrong.
    """
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs < 0).any(dim=-1) | ~(probs.sum(dim=-1) > 0)  # [rows]
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"{name} rows {rows[:8]} are not distributions: each row must be finite, "
                         f"non-negative and have positive mass")  # fmt: skip


class RejectionSampler:
    """Per-request sampler the engine calls after verification; a thin wrapper over the pure functions.

    ``use_triton_kernel`` runs the Triton kernel (CUDA, or ``TRITON_INTERPRET=1`` on CPU)
    instead of the torch path; both give identical tokens for the same seed.
    """

    def __init__(
        self,
        method: str = "probabilistic",
        synthetic_acceptance_rate: float = 0.0,
        use_triton_kernel: bool = False,
    ) -> None:
        validate_method(method, synthetic_acceptance_rate)
        self.method = method
        self.synthetic_acceptance_rate = synthetic_acceptance_rate
        self.use_triton_kernel = use_triton_kernel
        self._batch_sampler: BatchSampler = rejection_sample_batch
        if use_triton_kernel:
            from specdec.kernels import load_rejection_kernel

            self._batch_sampler = load_rejection_kernel()

    def __call__(
        self,
        draft_token_ids: torch.Tensor,  # [k] int64
        draft_probs: torch.Tensor | None,  # [k, vocab] q or None (one-hot)
        verify: VerifyResult,  # argmax [k + 1], probs [k + 1, vocab] or None
        seed: int,
        method: str | None = None,
        position: int | None = None,  # output index of row 0: draws keyed by position; None: by seed alone
        parents: Sequence[int] | None = None,  # the drafts form a tree (specdec.tree): judged by specdec.tree_sampler
    ) -> SampleResult:
        if parents is not None:
            return sample_tree(draft_token_ids.tolist(), parents, verify, seed, position, method or self.method,
                               self.synthetic_acceptance_rate)  # fmt: skip
        device = verify.argmax.device if verify.probs is None else verify.probs.device
        return _sample_one(
            self._batch_sampler, draft_token_ids, draft_probs, verify.probs, verify.argmax,
            method or self.method, _draws(seed, position, device), self.synthetic_acceptance_rate,
        )
