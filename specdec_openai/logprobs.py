"""Each output token's log probability, in OpenAI's two shapes (chat's ``logprobs.content``, completions' lists).

The Triton model returns, with ``return_log_probs``, the target's log probability of
each output token (penalised, biased and temperature-scaled, before top-k and top-p:
docs/serving.md#inputs-and-outputs), the token ids they belong to
(``output_token_ids``) and, with ``num_top_log_probs``, the likeliest tokens of the same
distribution at each position (``output_top_*``). Turning an id into OpenAI's ``token`` and ``bytes`` takes the
tokenizer (:class:`Vocabulary`). Where a token's text begins in the output is worked
out from the text pieces Triton sends (:class:`TokenLog`), so that a stop string that
cuts the text also cuts the tokens: those that begin at or after the cut are dropped.

Log probabilities of ``-inf`` become -9999.0, as vLLM writes them: JSON has no infinity.
"""
from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FLOOR = -9999.0  # what -inf is written as
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE = "\u2581"  # SentencePiece's word boundary


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    start: int  # where the token's text begins in the choice's output text, in characters
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens at its position (top_logprobs), likeliest first


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each printable stand-in character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class Vocabulary:
    """A token id's raw bytes and its text, as OpenAI's ``bytes`` and ``token`` give them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._bytes_of = _byte_decoder() if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The token's UTF-8 bytes; none for a special token (an EOS), which the output text leaves out too."""
        if token_id in self._special:
            return b""
        if token_id not in self._cache:
            self._cache[token_id] = self._bytes(self.tokenizer.convert_ids_to_tokens(token_id) or "")
        return self._cache[token_id]

    def _bytes(self, piece: str) -> bytes:
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if self._byte_level and all(char in self._bytes_of for char in piece):
            return bytes(self._bytes_of[char] for char in piece)
        return piece.replace(_SPACE, " ").encode("utf-8")

    def token(self, token_id: int) -> str:
        """The token's text; part of a multi-byte character shows as U+FFFD (its ``bytes`` hold the rest)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class TokenLog:
    """One choice's tokens, placed in its text as the pieces come, and handed out with the text they begin in."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[TokenLogprob] = []
        self._length = 0  # characters of output text seen

    def add(self, piece: str, token_ids: Sequence[int], log_probs: Sequence[float],
            tops: Sequence[tuple[tuple[int, float], ...]] = ()) -> None:  # fmt: skip
        """One Triton response: its text and the tokens that made it (Triton pairs ids, log probs and alternatives)."""
        start, end = self._length, self._length + len(piece)
        at = start
        tops = list(tops) or [()] * len(token_ids)
        for token_id, log_prob, top in zip(token_ids, log_probs, tops):
            self._pending.append(TokenLogprob(token_id, log_prob, min(at, end), top))
            at += len(self._decoder.decode(self.vocabulary.token_bytes(token_id)))
        self._length = end

    def release(self, upto: int | None) -> list[TokenLogprob]:
        """The tokens that begin before character ``upto`` of the output (None: all), each once."""
        if upto is None:
            out, self._pending = self._pending, []
            return out
        split = next((i for i, token in enumerate(self._pending) if token.start >= upto), len(self._pending))
        out, self._pending = self._pending[:split], self._pending[split:]
        return out


def _logprob(value: float) -> float:
    return max(value, FLOOR)


def _entry(vocabulary: Vocabulary, token_id: int, log_prob: float) -> dict[str, Any]:
    return {"token": vocabulary.token(token_id), "logprob": _logprob(log_prob),
            "bytes": list(vocabulary.token_bytes(token_id))}  # fmt: skip


def chat_logprobs(tokens: Sequence[TokenLogprob], vocabulary: Vocabulary) -> dict[str, Any]:
    """Chat's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``, ``top_logprobs``
    the ``top_logprobs`` likeliest tokens at the position (``[]`` when none were asked)."""
    content = [{**_entry(vocabulary, t.token_id, t.logprob),
                "top_logprobs": [_entry(vocabulary, token_id, lp) for token_id, lp in t.top]} for t in tokens]  # fmt: skip
    return {"content": content}


def completion_logprobs(tokens: Sequence[TokenLogprob], vocabulary: Vocabulary, offset: int = 0) -> dict[str, Any]:
    """Completions' ``choices[].logprobs``; ``top_logprobs`` maps the chosen token and the ``logprobs`` likeliest
    ones to their log probabilities, as vLLM's does (the chosen token alone with ``logprobs: 0``). ``offset``:
    characters before the output in the choice's text (an echoed prompt)."""
    names = [vocabulary.token(t.token_id) for t in tokens]
    tops = []
    for name, t in zip(names, tokens):
        top = {name: _logprob(t.logprob)}
        for token_id, lp in t.top:
            top.setdefault(vocabulary.token(token_id), _logprob(lp))
        tops.append(top)
    return {
        "tokens": names,
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": [offset + t.start for t in tokens],
    }
