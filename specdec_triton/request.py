"""The public generate I/O (TensorRT-LLM's names), parsed into engine parameters and back.

Every input but ``text_input`` is optional. Errors name the input, so a client can
tell what to fix; range checks the engine already makes
(``GenerationParams.validate``) are left to it, and its messages name the same fields.
Request parameters are refused (:func:`check_parameters`): every setting is an input.
TensorRT-LLM's other inputs (aliases, no-ops, refused ones) are sorted out first, in
:mod:`specdec_triton.trtllm`. Inputs may carry a leading batch dimension of 1 (the
``ensemble`` declares one, as TensorRT-LLM's does): every value is read flattened.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specdec.engine import GenerationParams
from specdec.grammar import GUIDE_TYPES, Grammar
from specdec.penalties import Penalties
from specdec.top_log_probs import MAX_TOP_LOG_PROBS, Alternatives
from specdec.types import RequestStats, SamplingParams, check_logit_bias
from specdec_triton import trtllm
from specdec_triton.plumbing import RequestError, bytes_array, scalar, text, texts

NATIVE_INPUTS = (
    "text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "min_p", "logit_bias_ids",
    "logit_bias_values", "seed", "stop_words",
    "end_id", "min_tokens", "exclude_input_in_output", "num_speculative_tokens",
    "bad_words", "repetition_penalty", "presence_penalty", "frequency_penalty", "return_log_probs",
    "num_top_log_probs", "guided_decoding_guide_type", "guided_decoding_guide",
)  # fmt: skip
GENERATE_INPUTS = NATIVE_INPUTS + trtllm.COMPAT_INPUTS
GENERATE_OUTPUTS = (
    "text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
    "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "cum_log_probs", "output_log_probs",
    "output_token_ids", "output_top_token_ids", "output_top_log_probs",
)  # fmt: skip


def check_parameters(parameters: Mapping[str, object], ignored: re.Pattern | None = None) -> None:
    """Refuses request parameters, naming them: this model reads every setting from its inputs.

    Over HTTP ``/generate`` a JSON key that names no input arrives as a request
    parameter, so without this a misspelt ``max_token`` would silently decode the
    default length. Names starting with ``triton_`` are Triton's own and pass, and so
    do names that ``ignored`` matches whole (headers that Triton forwards as parameters).
    """
    unknown = sorted(
        name for name in parameters
        if not name.startswith("triton_") and not (ignored is not None and ignored.fullmatch(name))
    )  # fmt: skip
    if not unknown:
        return
    described = []
    for name in unknown:
        close = difflib.get_close_matches(name, GENERATE_INPUTS, n=1)
        described.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise RequestError(
        f"unknown request parameter{'s' if len(unknown) > 1 else ''} {', '.join(described)}: every setting is an "
        f"input, one of {', '.join(GENERATE_INPUTS)}"
    )


@dataclass(frozen=True)
class GenerateRequest:
    text_input: str
    max_tokens: int | None  # None -> the model's default_max_tokens
    stream: bool
    sampling: SamplingParams  # greedy unless temperature >= 1e-5 (GREEDY_TEMPERATURE_BELOW)
    stop_words: tuple[str, ...]
    end_id: int | None  # replaces the tokenizer's EOS ids when given
    min_tokens: int
    exclude_input_in_output: bool  # non-streaming only: streamed responses never repeat the prompt
    num_speculative_tokens: int | None  # None -> the model's num_speculative_tokens; 0 = no speculation
    bad_words: tuple[str, ...] = ()  # each tokenized on its own, like stop_words
    penalties: Penalties = Penalties()  # bad_words' token ids are added by generation_params
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # with return_log_probs: each output token's likeliest alternatives
    # structured output, TensorRT-LLM's names: the guide type (specdec.grammar.GUIDE_TYPES) and its text;
    # compiled by the orchestrator, which holds the tokenizer
    guide_type: str | None = None
    guide: str = ""

    @classmethod
    def from_inputs(cls, inputs: Mapping[str, np.ndarray]) -> GenerateRequest:
        inputs = trtllm.to_native(inputs)
        prompt = text(inputs, "text_input")
        if not prompt:
            raise RequestError("input 'text_input' is required and must not be empty")
        stop_words, bad_words = _words(inputs, "stop_words"), _words(inputs, "bad_words")
        return cls(
            text_input=prompt,
            max_tokens=scalar(inputs, "max_tokens", int),
            stream=scalar(inputs, "stream", bool, False),
            sampling=SamplingParams(
                temperature=scalar(inputs, "temperature", float, 0.0),
                top_k=scalar(inputs, "top_k", int, 0),
                top_p=scalar(inputs, "top_p", float, 1.0),
                min_p=scalar(inputs, "min_p", float, 0.0),
                seed=scalar(inputs, "seed", int),
                logit_bias=_logit_bias(inputs),
            ),
            stop_words=stop_words,
            end_id=scalar(inputs, "end_id", int),
            min_tokens=scalar(inputs, "min_tokens", int, 0),
            exclude_input_in_output=scalar(inputs, "exclude_input_in_output", bool, False),
            num_speculative_tokens=scalar(inputs, "num_speculative_tokens", int),
            bad_words=bad_words,
            penalties=Penalties(
                repetition_penalty=scalar(inputs, "repetition_penalty", float, 1.0),
                presence_penalty=scalar(inputs, "presence_penalty", float, 0.0),
                frequency_penalty=scalar(inputs, "frequency_penalty", float, 0.0),
            ),
            return_log_probs=scalar(inputs, "return_log_probs", bool, False),
            num_top_log_probs=scalar(inputs, "num_top_log_probs", int, 0),
            **_guide(inputs),
        )

    def generation_params(
        self,
        default_max_tokens: int,
        max_speculative_tokens: int,
        eos_token_ids: Sequence[int],
        stop_token_sequences: Sequence[Sequence[int]],
        vocab_size: int,
        bad_word_sequences: Sequence[Sequence[int]] = (),
        grammar: Grammar | None = None,
    ) -> GenerationParams:
        k = max_speculative_tokens if self.num_speculative_tokens is None else self.num_speculative_tokens
        if not 0 <= k <= max_speculative_tokens:
            raise RequestError(
                f"input 'num_speculative_tokens' must be in [0, {max_speculative_tokens}] "
                f"(the model's num_speculative_tokens), got {k}"
            )
        if self.num_top_log_probs and not (self.return_log_probs and 0 < self.num_top_log_probs <= MAX_TOP_LOG_PROBS):
            raise RequestError(f"input 'num_top_log_probs' must be in [0, {MAX_TOP_LOG_PROBS}], and above 0 needs "
                               f"'return_log_probs' true; got {self.num_top_log_probs}")  # fmt: skip
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise RequestError(f"input 'end_id' must be a token id in [0, {vocab_size}), got {self.end_id}")
        outside = [token for token, _ in self.sampling.logit_bias if not 0 <= token < vocab_size]
        if outside:
            raise RequestError(f"input 'logit_bias_ids' must hold token ids in [0, {vocab_size}), got {outside}")
        return GenerationParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            min_tokens=self.min_tokens,
            num_speculative_tokens=k,
            sampling=self.sampling,
            eos_token_ids=(self.end_id,) if self.end_id is not None else tuple(eos_token_ids),
            stop_token_sequences=tuple(tuple(seq) for seq in stop_token_sequences),
            penalties=replace(self.penalties, bad_words=tuple(tuple(seq) for seq in bad_word_sequences)),
            return_log_probs=self.return_log_probs,
            num_top_log_probs=self.num_top_log_probs,
            grammar=grammar,
        )


def _guide(inputs: Mapping[str, np.ndarray]) -> dict:
    """The guide's type and text; a guide without its type, or a type it does not take, is refused by name."""
    guide_type, guide = text(inputs, "guided_decoding_guide_type"), text(inputs, "guided_decoding_guide")
    if not guide_type:  # TensorRT-LLM's client sends "" for none
        if guide:
            raise RequestError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type' (one of "
                               f"{', '.join(GUIDE_TYPES)})")  # fmt: skip
        return {}
    if guide_type not in GUIDE_TYPES:
        raise RequestError(f"input 'guided_decoding_guide_type' must be one of {', '.join(GUIDE_TYPES)}, "
                           f"got {guide_type!r}")  # fmt: skip
    if guide_type == "json" and guide:
        raise RequestError("input 'guided_decoding_guide' must be empty for guide type 'json' (any JSON value); "
                           "send a schema with guide type 'json_schema'")  # fmt: skip
    if guide_type != "json" and not guide:
        raise RequestError(f"input 'guided_decoding_guide' is required for guide type {guide_type!r}")
    return {"guide_type": guide_type, "guide": guide or ""}


def _logit_bias(inputs: Mapping[str, np.ndarray]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` as two inputs: the token ids, and the bias of each (added to its logit)."""
    ids = np.asarray(inputs.get("logit_bias_ids", np.zeros(0, np.int64))).reshape(-1)
    values = np.asarray(inputs.get("logit_bias_values", np.zeros(0, np.float32)), np.float32).reshape(-1)
    if len(ids) != len(values):
        raise RequestError(f"inputs 'logit_bias_ids' ({len(ids)} ids) and 'logit_bias_values' ({len(values)} "
                           "values) must have one value per id")  # fmt: skip
    bias = tuple(zip((int(t) for t in ids), (float(v) for v in values)))
    try:
        check_logit_bias(bias)
    except ValueError as err:
        raise RequestError(f"inputs 'logit_bias_ids' and 'logit_bias_values': {err}") from None
    return bias


def _words(inputs: Mapping[str, np.ndarray], name: str) -> tuple[str, ...]:
    words = tuple(texts(inputs, name) or ())
    if "" in words:
        raise RequestError(f"input '{name}' must not contain an empty string")
    return words


def generate_outputs(
    text_output: str,
    finish_reason: str | None,
    num_input_tokens: int,
    num_output_tokens: int,
    stats: RequestStats,
    log_probs: Sequence[float] = (),
    cum_log_prob: float = 0.0,
    token_ids: Sequence[int] = (),
    top_log_probs: Sequence[Alternatives] = (),
) -> dict[str, np.ndarray]:
    """One public response; the counts are cumulative over the request, ``finish_reason`` is '' until the end.

    ``log_probs`` are those of the tokens this response adds (all of them when not
    streaming), ``cum_log_prob`` their running sum over the request; both shaped as
    TensorRT-LLM's, with one beam: ``cum_log_probs`` ``[1]``, ``output_log_probs`` ``[1, tokens]``.
    ``token_ids`` are the ids of the tokens this response adds, ``[1, tokens]`` like
    ``output_log_probs`` and paired with it when both are filled: a client that shows
    each token's log probability (the OpenAI server) needs to know which token it was.
    ``top_log_probs``: each of those tokens' likeliest alternatives (``num_top_log_probs``),
    ``[1, tokens, n]`` ids and log probabilities; ``[1, tokens, 0]`` when none were asked.
    """
    n = len(top_log_probs[0]) if top_log_probs else 0
    top_shape = (1, len(top_log_probs) if n else len(token_ids), n)
    return {
        "text_output": bytes_array([text_output]),
        "finish_reason": bytes_array([finish_reason or ""]),
        "num_input_tokens": np.array([num_input_tokens], dtype=np.int32),
        "num_output_tokens": np.array([num_output_tokens], dtype=np.int32),
        "acceptance_rate": np.array([stats.acceptance_rate], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([stats.num_accepted_tokens], dtype=np.int32),
        "total_draft_tokens": np.array([stats.num_draft_tokens], dtype=np.int32),
        "cum_log_probs": np.array([cum_log_prob], dtype=np.float32),  # [beams]
        "output_log_probs": np.array([list(log_probs)], dtype=np.float32).reshape(1, -1),  # [beams, tokens]
        "output_token_ids": np.array([list(token_ids)], dtype=np.int32).reshape(1, -1),  # [beams, tokens]
        "output_top_token_ids": np.array([[t for t, _ in a] for a in top_log_probs], np.int32).reshape(top_shape),
        "output_top_log_probs": np.array([[v for _, v in a] for a in top_log_probs], np.float32).reshape(top_shape),
    }
