"""TensorRT-LLM's ensemble and ``tensorrt_llm_bls`` inputs: which are ours, aliases, no-ops or refused.

A client written for TensorRT-LLM's repositories sends inputs this server does not
implement (LoRA, multimodal, prompt tables, beams). Each of them is
declared in the public models' ``config.pbtxt`` with TensorRT-LLM's datatype and shape,
so that the request reaches the model and is refused by name here
(``unsupported input 'lora_task_id' ...``) instead of failing in Triton with an unknown
input or datatype. Every name below has one status:

* an *alias* of one of our inputs (names TensorRT-LLM used before ``seed`` and
  ``min_tokens``, and ``tensorrt_llm_bls``'s ``num_draft_tokens``);
* accepted at the one value that asks for nothing we lack (``beam_width`` 1, the
  ``return_*_logits`` flags false), refused at any other;
* accepted and without effect where TensorRT-LLM gives it none for one greedy or sampled
  sequence returned as text (``pad_id``, ``length_penalty``);
* refused whenever present.

The inputs this server implements under TensorRT-LLM's own names (``text_input``,
``max_tokens``, ``bad_words``, the penalties, ``return_log_probs``, guided decoding ...) are parsed in
:mod:`specdec_triton.request`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from specdec_triton.plumbing import RequestError

ALIASES = {"random_seed": "seed", "min_length": "min_tokens", "num_draft_tokens": "num_speculative_tokens"}

# name -> (the one accepted value, why no other is)
_BIAS_BY_IDS = "embedding bias by words is not supported; logit_bias_ids and logit_bias_values bias token ids"
_NO_LOGITS = "logits are not returned; return_log_probs gives the output's log probabilities"
ONLY_VALUE = {
    "beam_width": (1, "beam search is not supported: a request decodes one sequence (greedy or sampled)"),
    "num_return_sequences": (1, "a request returns one sequence"),
    "return_context_logits": (False, _NO_LOGITS),
    "return_generation_logits": (False, _NO_LOGITS),
    "return_perf_metrics": (False, "per-request KV-cache and timing figures are not kept; see the metrics port"),
}

# name -> why it changes nothing here
NO_EFFECT = {
    "pad_id": "outputs are text, never padded",
    "length_penalty": "TensorRT-LLM applies it to beam-search scores only, and a request has no beams",
}

# name -> why it is refused
UNSUPPORTED = {
    "decoder_text_input": "encoder-decoder models are not served",
    "image_input": "multimodal inputs are not served",
    "image_bytes_input": "multimodal inputs are not served",
    "image_url_input": "multimodal inputs are not served",
    "video_bytes_input": "multimodal inputs are not served",
    "prompt_embedding_table": "prompt tuning tables are not supported",
    "prompt_table_extra_id": "prompt tuning tables are not supported",
    "prompt_vocab_size": "prompt tuning tables are not supported",
    "embedding_bias_words": _BIAS_BY_IDS,
    "embedding_bias_weights": _BIAS_BY_IDS,
    "lora_task_id": "LoRA adapters are not supported",
    "lora_weights": "LoRA adapters are not supported",
    "lora_config": "LoRA adapters are not supported",
    "use_draft_logits": "the acceptance rule is the server's (rejection_sampler's rejection_sample_method)",
}

# Every compatibility input as TensorRT-LLM declares it (ensemble and tensorrt_llm_bls, without the batch
# dimension): the public config.pbtxt files declare the same, so a TensorRT-LLM client's tensors pass Triton.
DECLARED = {
    "random_seed": ("TYPE_UINT64", [1]), "min_length": ("TYPE_INT32", [1]), "num_draft_tokens": ("TYPE_INT32", [1]),
    "beam_width": ("TYPE_INT32", [1]), "num_return_sequences": ("TYPE_INT32", [1]),
    "return_context_logits": ("TYPE_BOOL", [1]), "return_generation_logits": ("TYPE_BOOL", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]), "pad_id": ("TYPE_INT32", [1]), "length_penalty": ("TYPE_FP32", [1]),
    "decoder_text_input": ("TYPE_STRING", [1]), "image_input": ("TYPE_FP16", [-1, 3, -1, -1]),
    "image_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1]), "image_url_input": ("TYPE_STRING", [1]),
    "video_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1]), "prompt_embedding_table": ("TYPE_FP16", [-1, -1]),
    "prompt_table_extra_id": ("TYPE_UINT64", [1]), "prompt_vocab_size": ("TYPE_INT32", [1]),
    "embedding_bias_words": ("TYPE_STRING", [-1]), "embedding_bias_weights": ("TYPE_FP32", [-1]),
    "lora_task_id": ("TYPE_UINT64", [1]), "lora_weights": ("TYPE_FP16", [-1, -1]),
    "lora_config": ("TYPE_INT32", [-1, 3]),
    "use_draft_logits": ("TYPE_BOOL", [1]),
}  # fmt: skip
COMPAT_INPUTS = tuple(DECLARED)


def to_native(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``inputs`` with aliases renamed and accepted no-ops dropped; raises RequestError naming what is refused."""
    refused = [name for name in UNSUPPORTED if name in inputs]
    if refused:
        name = refused[0]
        raise RequestError(f"unsupported input '{name}': {UNSUPPORTED[name]}")
    native = {name: array for name, array in inputs.items() if name not in NO_EFFECT}
    for name, (allowed, why) in ONLY_VALUE.items():
        if name in native:
            value = _one(native.pop(name), name)
            if value != allowed:
                raise RequestError(f"unsupported input '{name}' = {value}: {why}; only {allowed} is accepted")
    for alias, name in ALIASES.items():
        if alias in native:
            if name in native and _one(native[name], name) != _one(native[alias], alias):
                raise RequestError(f"inputs '{alias}' and '{name}' name the same setting with different values")
            native[name] = native.pop(alias)
    return native


def _one(array: np.ndarray, name: str):
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(np.shape(array))}")
    return values[0].item()
