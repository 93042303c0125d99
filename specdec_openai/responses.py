"""OpenAI response bodies: completions and chat, whole and as stream chunks; errors; the acceptance extension.

The acceptance figures go in a top-level ``metrics.speculative_decoding`` object, the
place and names vLLM's per-request spec-decode metrics use. Only what the Triton
outputs carry exactly is given: draft and accepted token counts and their ratio, and
the configured k (``num_spec_tokens``). vLLM's step-based fields
(``num_spec_steps``, ``mean_acceptance_length``, ``acceptance_histogram``) are left
out: a streamed Triton response covers one step only when that step produced text, so
counting responses would miscount steps.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec_openai.triton import Step


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

    def response(self, text: str, finish_reason: str, last: Step, num_spec_tokens: int | None) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage(last), "metrics": acceptance(last, num_spec_tokens)}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do; completions need nothing."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return {**self._head("chat.completion.chunk"), "choices": [_chunk_choice("chat", delta, None)]}

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            content = {"content": text} if text or finish_reason is None else {}
            return {**self._head("chat.completion.chunk"), "choices": [_chunk_choice("chat", content, finish_reason)]}
        return {**self._head("text_completion"), "choices": [_chunk_choice("completion", text, finish_reason)]}

    def final_chunk(self, text: str, finish_reason: str, last: Step, num_spec_tokens: int | None) -> dict[str, Any]:
        """The chunk with the finish reason; it carries the acceptance figures."""
        return {**self.chunk(text, finish_reason), "metrics": acceptance(last, num_spec_tokens)}

    def usage_chunk(self, last: Step) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(last)}


def _chunk_choice(kind: str, content: Any, finish_reason: str | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}


def usage(last: Step) -> dict[str, int]:
    return {
        "prompt_tokens": last.num_input_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_input_tokens + last.num_output_tokens,
    }


def acceptance(last: Step, num_spec_tokens: int | None) -> dict[str, Any]:
    drafted, accepted = last.total_draft_tokens, last.total_accepted_draft_tokens
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
