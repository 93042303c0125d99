"""Load Hugging Face causal LMs from local paths and run them with one KV cache per sequence.

``CachedCausalLM`` is the single owner of a model's per-sequence caches: the target
verifier and the draft proposer each wrap one. Every call names the ``position`` of
its first token; the cache is cut back to that length first (``DynamicCache.crop``),
so rolling back rejected drafts moves a length and recomputes nothing.
"""
from __future__ import annotations

import inspect
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *_DTYPES)


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a dtype name to ``torch.dtype``.

    ``"auto"`` is float32 on CPU (half precision there is slow and blurs greedy ties)
    and bfloat16 on CUDA (float16 where the GPU has no bfloat16).
    """
    if dtype == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_local_dir(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist or is not a directory")
    return path


def load_causal_lm(path: str | os.PathLike, dtype: str = "auto", device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load a local Hugging Face checkpoint in eval mode; never reaches a model hub."""
    path = _check_local_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device), local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    return AutoTokenizer.from_pretrained(_check_local_dir(path), local_files_only=True)


def model_vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits (the output embedding rows, which may pad ``config.vocab_size``)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def check_within_positions(max_model_len: int, max_position_embeddings: int | None) -> None:
    """A ``max_model_len`` past the model's ``max_position_embeddings`` is refused, as vLLM refuses it.

    Positions beyond it were never trained (absolute position embeddings have no row for
    them at all), and the KV cache would be sized for tokens the model cannot serve well.
    """
    if max_position_embeddings is not None and max_model_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_position_embeddings} "
            f"(its config.json); set max_model_len to at most {max_position_embeddings}"
        )


def _config_max_len(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Called per sequence and step with whole sequences (prompt + output), which differ
    only near the end; list comparisons run in C, so bisecting with them is about five
    times faster than a Python loop at 2k tokens (15 against 77 us on the 2-core CPU).
    """
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class OwnsOneModel:
    """What a verifier or draft proposer reports about the one cached model it owns (``self._lm``).

    ``_lm`` is a :class:`CachedCausalLM` or a :class:`specdec.fast.FastCausalLM`; both keep
    ``num_sequences``, ``vocab_size``, ``max_model_len`` and ``release``.
    """

    _lm: CachedCausalLM

    @property
    def num_active_sequences(self) -> int:
        return self._lm.num_sequences

    @property
    def vocab_size(self) -> int:
        return self._lm.vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self._lm.max_model_len

    def release(self, seq_id: str) -> None:
        self._lm.release(seq_id)


class CachedCausalLM:
    """One causal LM serving many sequences, each with its own ``DynamicCache``.

    Requests run one at a time: this is the generic path for any
    ``AutoModelForCausalLM`` (Llama, Qwen2, Mistral, GPT-2, OPT). A batched engine
    with a preallocated cache serves the same contract faster.
    """

    def __init__(self, model: PreTrainedModel, device: str | torch.device = "cpu", max_model_len: int | None = None):
        self.model = model
        self.device = torch.device(device)
        self.max_model_len = max_model_len if max_model_len is not None else _config_max_len(model.config)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len is not None:
            check_within_positions(self.max_model_len, _config_max_len(model.config))
        self.vocab_size = model_vocab_size(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._caches: dict[str, DynamicCache] = {}
        self._token_ids: dict[str, list[int]] = {}  # the tokens each cache holds, in order

    @property
    def num_sequences(self) -> int:
        return len(self._caches)

    def cached_token_ids(self, seq_id: str) -> list[int]:
        return self._token_ids.get(seq_id, [])

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)
        self._token_ids.pop(seq_id, None)

    @torch.inference_mode()
    def forward(self, seq_id: str, position: int, token_ids: list[int], num_logits: int) -> torch.Tensor:
        """Feed ``token_ids`` at ``position``; return float32 logits ``[num_logits, vocab]`` of the last positions."""
        cached = self.cached_token_ids(seq_id)
        self._check_request(seq_id, position, len(token_ids), num_logits, len(cached))
        cache = self._caches.get(seq_id)
        if cache is None or position == 0:
            cache = DynamicCache()
        elif position < len(cached):
            cache.crop(position - len(cached))  # a negative count removes that many trailing tokens
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        kwargs = {"logits_to_keep": num_logits} if self._logits_to_keep else {}
        try:
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs)
        except BaseException:
            self.release(seq_id)  # a half-updated cache must not be reused
            raise
        self._caches[seq_id] = out.past_key_values
        self._token_ids[seq_id] = cached[:position] + list(token_ids)
        return out.logits[0, -num_logits:].float()  # [num_logits, vocab]

    def _check_request(self, seq_id: str, position: int, num_tokens: int, num_logits: int, num_cached: int) -> None:
        if num_tokens == 0:
            raise ValueError(f"seq {seq_id!r}: token_ids must not be empty")
        if not 1 <= num_logits <= num_tokens:
            raise ValueError(f"seq {seq_id!r}: num_logits must be in [1, {num_tokens}], got {num_logits}")
        if not 0 <= position <= num_cached:
            raise ValueError(
                f"seq {seq_id!r}: position {position} is outside the {num_cached} tokens cached; "
                f"a call may only continue or cut back the cache"
            )
        if self.max_model_len is not None and position + num_tokens > self.max_model_len:
            raise ValueError(
                f"seq {seq_id!r}: {position + num_tokens} tokens exceed max_model_len={self.max_model_len}"
            )
