"""Structured output under speculation: a grammar's matcher, owned by the request's state machine.

The constrained target is the target whose logits are set to ``-inf`` wherever the
grammar forbids the next token (the way vLLM, SGLang and TensorRT-LLM apply
xgrammar; Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models"). Speculation stays lossless with respect to it when
every verified row gets the mask of its own prefix:

* row 0, after the committed tokens; row ``i``, after drafts ``1 .. i`` (a tree's node
  rows after their paths): ``GrammarState.masks`` walks the drafts through the matcher
  and rolls it back, so the sequence's matcher is only ever advanced by tokens that stay;
* a draft the grammar forbids has ``p = 0`` and could only be rejected, so the drafts
  after it are cut before verification (``GrammarState.allowed_drafts``,
  ``cut_proposal``): the target never scores what it cannot reach. The forbidden draft
  itself is cut too where ``q`` is one-hot (deterministic drafts, every tree): the
  recovered token is then drawn from ``(p - q)+ = p`` either way. Where the drafts were
  sampled from ``q`` it stays, as the last draft: cutting it would draw the token from
  ``p`` exactly when ``q`` drew a forbidden draft, instead of from the residual
  ``(p - q)+``, and the output would no longer follow ``p`` (Leviathan et al. 2023,
  Theorem 1 needs the draft rejected, not withdrawn);
* where the grammar allows a single next token (a schema's keys and punctuation), that token is
  drafted after the drafter's allowed drafts, up to the step's k, with a one-hot ``q``
  (``GrammarState.forced_after``): the constrained target always accepts it;
* a drafter in the matcher's process drafts under the grammar: each draft's logits are masked
  by ``GrammarState.allowed_after`` its earlier drafts (``guided_picks``), so its ``q`` puts no
  mass where ``p`` is 0 and its drafts are never cut. Any ``q`` keeps rejection sampling
  lossless; this one only stops wasting drafts. The rows it fills are kept until the next
  ``accept`` and reused by ``masks``, which needs the same prefixes for verification;
* ``GrammarState.accept`` advances the matcher by the tokens the sampler emitted.

EOS is allowed only where the grammar accepts termination (the request's EOS ids are
the matcher's stop tokens); a matcher that took its stop token has *terminated*, and the
request ends with ``stop``. The matcher lives in the process of the sequence's tokens
(the engine loop, the Triton orchestrator); only the packed masks travel, one int32 word
per 32 tokens (``VerifyRequest.allowed_tokens``).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.sampling import process_logits, sample_from_probs
from specdec.tree import ROOT
from specdec.types import DraftGuide, Proposal, ProposeRequest

# What a guide describes; TensorRT-LLM's guided_decoding_guide_type names ("json": any JSON value, no guide).
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
# JSON without free whitespace: whitespace is no part of a value, and a model that may emit
# it anywhere can spend its whole max_tokens on it; values are separated as json.dumps does
# (", " and ": ")
_JSON_OPTIONS = {"any_whitespace": False}
_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " before a message
_ANY_VALUE = "{}"  # the schema every JSON value meets: guide type "json", as TensorRT-LLM's


class GrammarError(ValueError):
    """A guide the grammar engine refuses; the message names the guide type and says why."""


@dataclass(frozen=True)
class Grammar:
    """A compiled guide, shared by every request that sends the same one (the compiler caches them)."""

    guide_type: str
    compiled: object  # xgrammar.CompiledGrammar
    vocab_size: int  # width of the masks: the target's logits
    guide: str = ""  # the text compiled, for a drafter in another process to compile too (GuideSpec)


class GrammarCompiler:
    """Compiles guides for one tokenizer and one logit width (the target's ``vocab_size``)."""

    def __init__(self, tokenizer, vocab_size: int):
        """``tokenizer``: a Hugging Face tokenizer, or an ``xgrammar.TokenizerInfo`` (a vocabulary made up)."""
        import xgrammar  # imported here: only servers and tests that constrain output need it

        info = tokenizer
        if not isinstance(tokenizer, xgrammar.TokenizerInfo):
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.tokenizer_info = info
        self._compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def compile(self, guide_type: str, guide: str) -> Grammar:
        """The grammar of ``guide``; a ``GrammarError`` naming ``guide_type`` when it is not one."""
        if guide_type not in GUIDE_TYPES:
            raise GrammarError(f"guide type must be one of {', '.join(GUIDE_TYPES)}, got {guide_type!r}")
        try:
            if guide_type == "json":
                compiled = self._compiler.compile_json_schema(_ANY_VALUE, **_JSON_OPTIONS)
            elif guide_type == "json_schema":
                json.loads(guide)  # a clearer message than the engine's for text that is not JSON at all
                compiled = self._compiler.compile_json_schema(guide, **_JSON_OPTIONS)
            elif guide_type == "regex":
                compiled = self._compiler.compile_regex(guide)
            elif guide_type == "structural_tag":
                tag = _without_free_whitespace(json.loads(guide))
                compiled = self._compiler.compile_structural_tag(json.dumps(tag))
            else:
                compiled = self._compiler.compile_grammar(guide)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar raises RuntimeError for bad guides
            reason = _ENGINE_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            raise GrammarError(f"{guide_type} guide does not compile: {reason}") from None
        return Grammar(guide_type, compiled, self.vocab_size, guide)


def _without_free_whitespace(node: object) -> object:
    """A structural tag (xgrammar's JSON format) whose plain JSON-schema parts admit no free whitespace either.

    xgrammar's structural tags let whitespace run freely in JSON content, where a small
    model may spend its whole ``max_tokens``; each such part becomes the grammar of its
    schema without it, as the ``json_schema`` guide type is compiled (``_JSON_OPTIONS``).
    """
    import xgrammar

    if isinstance(node, list):
        return [_without_free_whitespace(item) for item in node]
    if not isinstance(node, dict):
        return node
    plain = set(node) <= {"type", "json_schema", "style"} and node.get("style", "json") == "json"
    if node.get("type") == "json_schema" and plain:
        schema = node["json_schema"] if isinstance(node["json_schema"], dict) else {}
        ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), **_JSON_OPTIONS))
        return {"type": "grammar", "grammar": ebnf}
    return {key: _without_free_whitespace(value) for key, value in node.items()}


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarState:
    """One request's matcher: advanced only by the tokens that stay in its output."""

    def __init__(self, grammar: Grammar, stop_token_ids: Sequence[int] = ()):
        import xgrammar

        stops = list(stop_token_ids) or None  # none given: the tokenizer's own
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=stops)
        self.vocab_size = grammar.vocab_size
        self.stop_token_ids = tuple(self._matcher.stop_token_ids)
        # the mask rows filled since the last accept, by the drafts after the committed tokens
        self._rows: dict[tuple[int, ...], torch.Tensor | None] = {}  # each [1, words] int32; None: not reachable

    @property
    def terminated(self) -> bool:
        """The grammar took its stop token: the output is complete."""
        return self._matcher.is_terminated()

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance by emitted tokens; one the mask allowed is always accepted, so a refusal is a bug upstream."""
        self._rows.clear()
        for token in token_ids:
            if self._matcher.is_terminated():
                return  # the sequence ended at its stop token; the tokens after it are not kept
            if not self._matcher.accept_token(int(token)):
                raise ValueError(f"token {int(token)} was emitted where the grammar forbids it")

    def allowed_after(self, drafts: Sequence[int]) -> torch.Tensor | None:
        """``[1, ceil(vocab / 32)]`` int32: the tokens the grammar allows after the committed tokens and
        ``drafts`` (a chain); None where the grammar refuses a draft or took its stop token (those drafts are
        cut before verification, so what follows them needs no mask). The matcher is rolled back."""
        key = tuple(int(t) for t in drafts)
        if key not in self._rows:
            accepted = self._advance(key, list(range(len(key))))
            row = None
            if accepted == len(key) and not self._matcher.is_terminated():
                import xgrammar

                row = xgrammar.allocate_token_bitmask(1, self.vocab_size)
                self._matcher.fill_next_token_bitmask(row, 0)
            self._matcher.rollback(accepted)
            self._rows[key] = row
        return self._rows[key]

    def allowed_drafts(self, drafts: Sequence[int], parents: Sequence[int] | None = None,
                       keep_first_forbidden: bool = False) -> list[int]:  # fmt: skip
        """Indices of the drafts whose whole path the grammar allows; a chain's are a prefix, followed by its
        first forbidden draft if ``keep_first_forbidden`` (a chain sampled from ``q``: see the module's docstring).

        A draft after a stop token is cut too: the sequence would end at the stop token.
        """
        kept: list[int] = []
        ok: list[bool] = []
        for node in range(len(drafts)):
            parent = node - 1 if parents is None else parents[node]
            if parent != ROOT and not ok[parent]:
                ok.append(False)
                continue
            path = _path(parents, node)
            ok.append(self._walk_allows(drafts, path))
            if ok[-1]:
                kept.append(node)
            elif parents is None:
                return kept + [node] if keep_first_forbidden else kept
        return kept

    def forced_after(self, drafts: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens the grammar forces after the committed tokens and ``drafts`` (a chain it allows), at most
        ``max_tokens``: each the one token its mask allows. The matcher is rolled back.

        Drafted with a one-hot ``q``, a forced token is lossless like any deterministic draft, and the
        constrained target, whose ``p`` is 1 there, always accepts it: a step verifies it for the cost of a row.
        """
        import xgrammar

        accepted = self._advance(drafts, list(range(len(drafts))))
        forced: list[int] = []
        row = None  # [1, words] int32, made once something is forced as text
        while accepted == len(drafts) and len(forced) < max_tokens and not self._matcher.is_terminated():
            if not self._matcher.find_jump_forward_string():  # nothing forced as text: no single token either
                break
            if row is None:
                row = xgrammar.allocate_token_bitmask(1, self.vocab_size)
            self._matcher.fill_next_token_bitmask(row, 0)
            allowed = torch.nonzero(allowed_bool(row, self.vocab_size)[0]).flatten()
            if len(allowed) != 1 or not self._matcher.accept_token(int(allowed[0])):
                break
            forced.append(int(allowed[0]))
        self._matcher.rollback(accepted + len(forced))
        return forced

    def masks(self, drafts: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """``[len(drafts) + 1, ceil(vocab / 32)]`` int32 bitmask: row 0 after the committed tokens, row ``j + 1``
        after draft ``j``'s path; the matcher is rolled back. A row after a forbidden draft (kept as a chain's
        last, ``allowed_drafts``) or after a stop token is never read: it allows everything."""
        import xgrammar

        rows = xgrammar.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)  # [n + 1, words] int32
        for index, path in enumerate([[]] + [_path(parents, node) for node in range(len(drafts))]):
            row = self.allowed_after([drafts[node] for node in path])
            rows[index] = -1 if row is None else row[0]  # after a refused draft or a stop token: never read
        return rows

    def _walk_allows(self, drafts: Sequence[int], path: list[int]) -> bool:
        accepted = self._advance(drafts, path)
        self._matcher.rollback(accepted)
        return accepted == len(path)

    def _advance(self, drafts: Sequence[int], path: list[int]) -> int:
        """Accept the path's drafts up to the first refused one (or a stop token not last); how many were."""
        for depth, node in enumerate(path):
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(drafts[node])):
                return depth
        return len(path)


def _path(parents: Sequence[int] | None, node: int) -> list[int]:
    if parents is None:
        return list(range(node + 1))
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def cut_proposal(proposal: Proposal, kept: list[int]) -> Proposal:
    """``proposal`` with only the ``kept`` drafts (ascending), its tree re-indexed, ``q`` rows picked.

    A ``q`` held in the sampler (``probs_held``) is read there by its drafts' prefix, so
    a tree with held ``q`` keeps only its longest prefix of kept nodes.
    """
    n = len(proposal.token_ids)
    if len(kept) == n:
        return proposal
    if proposal.probs_held or proposal.parents is None:
        prefix = 0
        while prefix < len(kept) and kept[prefix] == prefix:
            prefix += 1
        kept = kept[:prefix]
    index = torch.tensor(kept, dtype=torch.long, device=proposal.token_ids.device)
    parents = None
    if proposal.parents is not None:
        new = {old: i for i, old in enumerate(kept)}
        parents = tuple(ROOT if proposal.parents[old] == ROOT else new[proposal.parents[old]] for old in kept)
    probs = None if proposal.probs is None else proposal.probs[index.to(proposal.probs.device)]
    return replace(proposal, token_ids=proposal.token_ids[index], probs=probs, parents=parents)


def with_drafts_appended(proposal: Proposal | None, token_ids: list[int]) -> Proposal | None:
    """``proposal`` (a chain, or None) with ``token_ids`` drafted after it, each with a one-hot ``q`` where
    the proposal carries ``q``; unchanged where its ``q`` rows are too narrow to name them."""
    if proposal is None:
        return Proposal(torch.tensor(token_ids, dtype=torch.long))
    probs = proposal.probs  # [k', vocab] or None
    if probs is not None and max(token_ids) >= probs.shape[1]:
        return proposal
    appended = torch.tensor(token_ids, dtype=proposal.token_ids.dtype, device=proposal.token_ids.device)  # [f]
    if probs is not None:
        one_hot = torch.zeros(len(token_ids), probs.shape[1], dtype=probs.dtype, device=probs.device)  # [f, vocab]
        one_hot[torch.arange(len(token_ids)), appended.to(probs.device)] = 1
        probs = torch.cat([probs, one_hot])
    return replace(proposal, token_ids=torch.cat([proposal.token_ids, appended]), probs=probs)


def allowed_bool(allowed_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [rows, vocab] bool
    """Unpack ``[rows, ceil(vocab / 32)]`` int32 words (bit ``b`` of word ``w``: token ``32 w + b``)."""
    bits = torch.arange(32, dtype=torch.int32, device=allowed_tokens.device)
    unpacked = (allowed_tokens.to(torch.int32)[:, :, None] >> bits) & 1  # [rows, words, 32]
    return unpacked.reshape(allowed_tokens.shape[0], -1)[:, :vocab_size].bool()


def apply_allowed(logits: torch.Tensor, allowed_tokens: torch.Tensor | None) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` at ``-inf`` where the grammar forbids the row's next token (a copy)."""
    if allowed_tokens is None:
        return logits
    if allowed_tokens.shape[0] != logits.shape[0] or allowed_tokens.shape[1] != num_mask_words(logits.shape[-1]):
        raise ValueError(f"allowed_tokens must be [{logits.shape[0]}, {num_mask_words(logits.shape[-1])}] for "
                         f"logits {list(logits.shape)}, got {list(allowed_tokens.shape)}")  # fmt: skip
    allowed = allowed_bool(allowed_tokens.to(logits.device), logits.shape[-1])  # [rows, vocab]
    return logits.float().masked_fill(~allowed, float("-inf"))


def guided_row(logits: torch.Tensor, guide: DraftGuide | None, drafts: Sequence[int]) -> torch.Tensor:
    """A chain drafter's next row ``[1, vocab]`` at ``-inf`` where ``guide`` forbids a token after ``drafts``;
    the row unmasked where the drafter gives no allowed token any mass (a head's reduced vocabulary): its
    draft is then cut before verification, as an unguided one would be."""
    if guide is None:
        return logits
    masked = apply_allowed(logits, guide.allowed_after(drafts))  # [1, vocab]
    return masked if bool(torch.isfinite(masked).any()) else logits


def guided_picks(logits: torch.Tensor, request: ProposeRequest,
                 generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:  # fmt: skip
    """Drafts from ``logits`` ``[k, vocab]`` (row ``j`` drafts ``j``), each row masked by ``request.guide``
    after the drafts before it: its argmax where ``generator`` is None, else a draw from its ``q``; and
    the ``[k, vocab]`` q rows drawn from (None when greedy).

    For drafters whose rows come from one forward (PARD, DFlash, Medusa): row ``j`` was computed
    without draft ``j - 1``, but its mask must follow it, so the picks are made one by one. A
    grammar excludes ``min_tokens`` (``GenerationParams.validate``), so nothing else is banned.
    """
    drafts: list[int] = []
    q_rows: list[torch.Tensor] = []
    for j in range(logits.shape[0]):
        row = guided_row(logits[j : j + 1], request.guide, drafts)  # [1, vocab]
        if generator is None:
            drafts.append(int(row.argmax()))
        else:
            q_rows.append(process_logits(row, request.sampling))  # [1, vocab]
            drafts.append(int(sample_from_probs(q_rows[-1], generator)))
    return drafts, torch.cat(q_rows) if q_rows else None
