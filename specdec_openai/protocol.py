"""OpenAI request bodies, checked, and their mapping onto the Triton model's public inputs.

Every field a request may carry is declared; any other is refused with an error naming
it (OpenAI's own API does the same), so a misspelt ``max_token`` cannot fall back to a
default unnoticed. Fields OpenAI defines that this server cannot honour are accepted
only at their neutral value (``suffix`` null) and refused by
name otherwise, with the reason (:data:`REFUSED`). ``top_k``, ``min_tokens``,
``repetition_penalty`` and ``num_speculative_tokens`` are extensions, as vLLM accepts
the first three.

Defaults follow OpenAI's, not the Triton model's: an absent ``temperature`` is 1
(sampling), as in OpenAI's API and vLLM; send ``temperature: 0`` for greedy output.
An absent ``max_tokens`` leaves the Triton model's ``default_max_tokens``.

One request may ask for several choices (``n``, ``best_of``, a list of prompts); each
is one Triton request (:class:`GenerateParams`), numbered as vLLM numbers them:
prompt ``i``'s choice ``j`` has index ``i * n + j``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

OPENAI_DEFAULT_TEMPERATURE = 1.0
MAX_CHOICES = 16  # Triton requests one OpenAI request may start: each holds a sequence slot while it runs
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
PENALTY_BOUND = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]


class RequestError(ValueError):
    """A request the server refuses; ``param`` names the field, as OpenAI's error body does."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted at false only


def _penalty() -> Any:
    return Field(default=0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND, allow_inf_nan=False)


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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None  # an end-user id for the caller's own records; unread
    presence_penalty: float = _penalty()
    frequency_penalty: float = _penalty()
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    # extensions
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # vLLM's; 1: off
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's; 0: off
    min_tokens: int | None = Field(default=None, ge=0)
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    # structured output (specdec_openai.structured): OpenAI's, then vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token; 0: the chosen only
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template as given
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM's extension: the template's assistant header
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: extra template variables


# field -> (its neutral value, why any other is refused); docs/openai.md#refused-fields says the same
REFUSED = {
    "suffix": (None, "fill-in-the-middle is not implemented"),
}  # fmt: skip
LOGIT_BIAS_BOUND = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class GenerateParams:
    """What one choice asks of the Triton model: its public inputs, by name (``None``: not sent)."""

    text_input: str
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop_words: tuple[str, ...]
    min_tokens: int | None
    num_speculative_tokens: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_p: float | None = None
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # each token's likeliest alternatives (with return_log_probs)
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide_type: str | None = None  # structured output (specdec_openai.structured): the server's guide type
    guide: str | None = None

    def triton_inputs(self) -> dict[str, Any]:
        """Inputs for a streamed request; a ``None`` (or a neutral penalty) is left out: the model's default applies.

        ``stop_words`` go too, though the OpenAI server matches stop strings on the text
        (:mod:`specdec_openai.stops`): Triton's token match ends the sequence on the
        server where cancelling cannot (``ensemble``, which does not pass cancellation on).
        """
        values = {
            "text_input": self.text_input, "stream": True, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p or None,
            "seed": self.seed,
            "stop_words": list(self.stop_words) or None, "min_tokens": self.min_tokens,
            "num_speculative_tokens": self.num_speculative_tokens,
            "presence_penalty": self.presence_penalty or None, "frequency_penalty": self.frequency_penalty or None,
            "repetition_penalty": self.repetition_penalty, "return_log_probs": self.return_log_probs or None,
            "num_top_log_probs": self.num_top_log_probs or None,
            "logit_bias_ids": [t for t, _ in self.logit_bias] or None,
            "logit_bias_values": [b for _, b in self.logit_bias] or None,
            "guided_decoding_guide_type": self.guide_type, "guided_decoding_guide": self.guide,
        }  # fmt: skip
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class Plan:
    """One OpenAI request as Triton requests: ``choices[i]`` is the choice with index ``i`` (before ``best_of``)."""

    choices: tuple[GenerateParams, ...]
    n: int  # choices returned per prompt
    best_of: int  # choices generated per prompt; > n: the n with the highest cumulative log probability are kept
    logprobs: int | None  # None: no logprobs in the response; else the alternatives asked per token
    echo: tuple[str, ...] = ()  # completions' echo: each prompt, put before its choices' text
    tools: Any = None  # chat's specdec_openai.tools.ToolChoice, where calls are read from the text; None: plain text

    @property
    def needs_tokens(self) -> bool:
        """Whether each choice's tokens are followed: for logprobs, or to rank ``best_of`` choices by theirs."""
        return self.logprobs is not None or self.best_of > self.n


def check_supported(request: _Sampling) -> None:
    """Refuse, by name and with the reason, every field set to a value this server cannot honour."""
    for name, (neutral, why) in REFUSED.items():
        value = getattr(request, name, neutral)
        if not (value == neutral or (neutral is None and value in ({}, []))):
            raise RequestError(f"unsupported parameter '{name}': {why}; only {neutral!r} is accepted", name)
    if request.stream_options is not None:
        if not request.stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if request.stream_options.continuous_usage_stats:
            raise RequestError("unsupported parameter 'stream_options.continuous_usage_stats': usage is given once, "
                               "at the end", "stream_options")  # fmt: skip


def stop_words(stop: str | list[str] | None) -> tuple[str, ...]:
    words = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not word for word in words):
        raise RequestError("'stop' must not contain an empty string", "stop")
    return tuple(words)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed``: the request's own for the first, so that
    ``n: 1`` and ``n: 2`` agree on it, then a hash of both, so that choices differ and no two seeds collide."""
    if seed is None or index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")


def completion_plan(request: CompletionRequest) -> Plan:
    check_supported(request)
    prompts = _prompts(request.prompt)
    best_of = request.n if request.best_of is None else request.best_of
    if best_of < request.n:
        raise RequestError(f"'best_of' ({best_of}) must be at least 'n' ({request.n})", "best_of")
    if best_of > request.n and request.stream:
        raise RequestError("'best_of' above 'n' cannot be streamed: the best choices are known at the end only",
                           "best_of")  # fmt: skip
    if request.echo and request.logprobs is not None:
        raise RequestError("'echo' with 'logprobs' is not supported: the Triton model returns no log probabilities "
                           "for the prompt's tokens", "echo")  # fmt: skip
    if len(prompts) * best_of > MAX_CHOICES:
        raise RequestError(f"{len(prompts)} prompt(s) x {best_of} choices is more than {MAX_CHOICES} (the most "
                           f"choices one request may generate)", "best_of" if best_of > request.n else "n")  # fmt: skip
    logprobs = request.logprobs is not None or best_of > request.n  # best_of ranks by the log probabilities
    base = [_params(request, prompt, request.max_tokens, logprobs, request.logprobs or 0) for prompt in prompts]
    return _plan(request, base, best_of, request.logprobs, prompts if request.echo else ())


def chat_plan(request: ChatCompletionRequest, prompt: str) -> Plan:
    """``prompt``: the messages rendered by the chat template (:mod:`specdec_openai.chat`)."""
    check_supported(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise RequestError("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    if request.top_logprobs is not None and not request.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs' true", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _params(request, prompt, request.max_completion_tokens or request.max_tokens, logprobs is not None,
                     logprobs or 0)  # fmt: skip
    return _plan(request, [params], request.n, logprobs, ())


def _plan(request: _Sampling, base: list[GenerateParams], best_of: int, logprobs: int | None,
          echoed: list[str] | tuple[str, ...]) -> Plan:  # fmt: skip
    """Each prompt's ``best_of`` choices, seeded apart (:func:`choice_seed`) when the request has a seed."""
    choices = [replace(params, seed=choice_seed(request.seed, j)) for params in base for j in range(best_of)]
    return Plan(tuple(choices), request.n, best_of, logprobs, tuple(echoed))


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise RequestError("'prompt' must not be an empty list", "prompt")
    if not all(isinstance(p, str) for p in prompts):
        raise RequestError("'prompt' as token ids is not supported: the Triton model takes text, and decoding the "
                           "ids to text and tokenizing it again need not give the same ids; send the text",
                           "prompt")  # fmt: skip
    if not all(prompts):
        raise RequestError("'prompt' must not be empty", "prompt")
    return prompts


def logit_bias(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to a bias in [-100, 100]; a bad key or value is refused naming it.

    Ids past the vocabulary are refused by the Triton model, which knows the target's
    vocabulary (:func:`name_logit_bias`)."""
    pairs = []
    for key, bias in (value or {}).items():
        if not key.strip().isdigit():
            raise RequestError(f"'logit_bias' key {key!r} is not a token id (a non-negative integer)", "logit_bias")
        if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
            raise RequestError(f"'logit_bias' value {bias} of key {key!r} is outside [-100, 100]", "logit_bias")
        pairs.append((int(key), float(bias)))
    if len({token for token, _ in pairs}) != len(pairs):
        raise RequestError("'logit_bias' names a token id twice", "logit_bias")
    return tuple(pairs)


def name_logit_bias(err: RequestError) -> RequestError:
    """The Triton model's refusal of a token id (it names ``logit_bias_ids``) as the request's ``logit_bias``."""
    if err.param is not None or "'logit_bias_ids'" not in err.message:
        return err
    return RequestError(f"'logit_bias' keys must be token ids of the model: {err.message}", "logit_bias",
                        err.status, err.code)  # fmt: skip


def _params(request: _Sampling, prompt: str, max_tokens: int | None, logprobs: bool,
            top_logprobs: int = 0) -> GenerateParams:  # fmt: skip
    temperature = OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    return GenerateParams(
        text_input=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop_words=stop_words(request.stop),
        min_tokens=request.min_tokens,
        num_speculative_tokens=request.num_speculative_tokens,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        return_log_probs=logprobs,
        num_top_log_probs=top_logprobs,
        logit_bias=logit_bias(request.logit_bias),
    )
