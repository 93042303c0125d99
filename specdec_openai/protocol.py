"""OpenAI request bodies, checked, and their mapping onto the Triton model's public inputs.

Every field a request may carry is declared; any other is refused with an error naming
it (OpenAI's own API does the same), so a misspelt ``max_token`` cannot fall back to a
default unnoticed. Fields OpenAI defines that this server cannot honour are accepted
only at their neutral value (``logprobs`` null, ``presence_penalty`` 0, ...) and refused
by name otherwise. ``top_k``, ``min_tokens`` and ``num_speculative_tokens`` are
extensions, as vLLM accepts ``top_k`` and ``min_tokens``.

Defaults follow OpenAI's, not the Triton model's: an absent ``temperature`` is 1
(sampling), as in OpenAI's API and vLLM; send ``temperature: 0`` for greedy output.
An absent ``max_tokens`` leaves the Triton model's ``default_max_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

OPENAI_DEFAULT_TEMPERATURE = 1.0


class RequestError(ValueError):
    """A request the server refuses; ``param`` names the field, as OpenAI's error body does."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted at false only (see _NEUTRAL)


class _Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None  # an end-user id for the caller's own records; unread
    # OpenAI fields honoured only at their neutral value
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # extensions
    top_k: int | None = Field(default=None, ge=0)
    min_tokens: int | None = Field(default=None, ge=0)
    num_speculative_tokens: int | None = Field(default=None, ge=0)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as given
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM's extension: the template's assistant header
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: extra template variables


# field -> its neutral value; any other value is refused by name
_NEUTRAL = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "logprobs": None, "echo": False,
    "best_of": None, "suffix": None, "top_logprobs": None, "tools": None, "tool_choice": None,
    "response_format": None, "parallel_tool_calls": None,
}  # fmt: skip


@dataclass(frozen=True)
class GenerateParams:
    """What one OpenAI request asks of the Triton model: its public inputs, by name (``None``: not sent)."""

    text_input: str
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop_words: tuple[str, ...]
    min_tokens: int | None
    num_speculative_tokens: int | None

    def triton_inputs(self) -> dict[str, Any]:
        """Inputs for a streamed request; a ``None`` is left out so that the model's default applies."""
        values = {
            "text_input": self.text_input, "stream": True, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop_words": list(self.stop_words) or None, "min_tokens": self.min_tokens,
            "num_speculative_tokens": self.num_speculative_tokens,
        }  # fmt: skip
        return {name: value for name, value in values.items() if value is not None}


def check_supported(request: _Sampling) -> None:
    """Refuse, by name, every field set to a value this server cannot honour."""
    if request.n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {request.n}", "n")
    for name, neutral in _NEUTRAL.items():
        value = getattr(request, name, neutral)
        if not (value == neutral or (neutral is None and value in ({}, []))):
            raise RequestError(f"unsupported parameter '{name}': only {neutral!r} is accepted, got {value!r}", name)
    if request.stream_options is not None:
        if not request.stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if request.stream_options.continuous_usage_stats:
            raise RequestError("unsupported parameter 'stream_options.continuous_usage_stats'", "stream_options")


def stop_words(stop: str | list[str] | None) -> tuple[str, ...]:
    words = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not word for word in words):
        raise RequestError("'stop' must not contain an empty string", "stop")
    return tuple(words)


def completion_params(request: CompletionRequest) -> GenerateParams:
    check_supported(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if len(prompts) != 1:
        raise RequestError(f"'prompt' must be one string (one prompt per request), got {len(prompts)}", "prompt")
    if not prompts[0]:
        raise RequestError("'prompt' must not be empty", "prompt")
    return _params(request, prompts[0], request.max_tokens)


def chat_params(request: ChatCompletionRequest, prompt: str) -> GenerateParams:
    """``prompt``: the messages rendered by the chat template (:mod:`specdec_openai.chat`)."""
    check_supported(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise RequestError("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    return _params(request, prompt, request.max_completion_tokens or request.max_tokens)


def _params(request: _Sampling, prompt: str, max_tokens: int | None) -> GenerateParams:
    temperature = OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    return GenerateParams(
        text_input=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop_words=stop_words(request.stop),
        min_tokens=request.min_tokens,
        num_speculative_tokens=request.num_speculative_tokens,
    )

