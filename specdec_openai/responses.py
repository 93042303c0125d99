"""OpenAI response bodies: completions and chat, whole and as stream chunks; errors; the acceptance extension.

The acceptance figures go in a top-level ``metrics.speculative_decoding`` object, the
place and names vLLM's per-request spec-decode metrics use. Only what the Triton
outputs carry exactly is given: draft and accepted token counts and their ratio, and
the configured k (``num_spec_tokens``). vLLM's step-based fields
(``num_spec_steps``, ``mean_acceptance_length``, ``acceptance_histogram``) are left
out: a streamed Triton response covers one step only when that step produced text, so
counting responses would miscount steps. With several choices the response's figures
sum over them; each choice's last chunk carries its own.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Envelope:
    """What every chunk and response of one request repeats."""

    kind: str  # "completion" | "chat"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, kind: str, model: str) -> Envelope:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return cls(kind, model, prefix + uuid.uuid4().hex)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, int], metrics: dict[str, Any]) -> dict[str, Any]:
        """The whole (non-streamed) response; ``choices`` from :meth:`whole_choice`."""
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        return {**body, "choices": choices, "usage": usage, "metrics": metrics}

    def whole_choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None,
                     message: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """``message``: chat's, when it is more than the text (tool calls: :mod:`specdec_openai.tools`)."""
        if self.kind == "chat":
            message = message or {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role, as OpenAI's do; completions need nothing."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None,
              metrics: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """One piece of choice ``index``; the one with the finish reason carries the choice's acceptance figures.
        ``delta``: chat's, when it is not the text's (tool calls)."""
        if self.kind == "chat":
            content = {"content": text} if text or finish_reason is None else {}
            content = delta if delta is not None else content
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        return body if metrics is None else {**body, "metrics": metrics}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def acceptance(drafted: int, accepted: int, num_spec_tokens: int | None) -> dict[str, Any]:
    figures = {
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": num_spec_tokens,
    }
    return {"speculative_decoding": figures}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")
