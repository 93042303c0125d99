"""Load Hugging Face causal LMs from local paths: the ``hf`` engine of the ``CachedLM`` contract.

``CachedCausalLM`` owns one ``DynamicCache`` per sequence for any
``AutoModelForCausalLM`` (Llama, Qwen2, Mistral, GPT-2, OPT). Every call names the
``position`` of its first token; the cache is cut back to that length first
(``DynamicCache.crop``), so rolling back rejected drafts moves a length and recomputes
nothing. The fast engine (``specdec.fast.FastCausalLM``) keeps the same contract.
"""
from __future__ import annotations

import inspect
import json
import os

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specdec.cached_lm import DTYPE_CHOICES, DTYPES, ForwardCall, check_forward_calls, check_model_dir



def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a dtype name to ``torch.dtype``.

    ``"auto"`` is float32 on CPU (half precision there is slow and blurs greedy ties)
    and bfloat16 on CUDA (float16 where the GPU has no bfloat16).
    """
    if dtype == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    return DTYPES[dtype]


def load_causal_lm(path: str | os.PathLike, dtype: str = "auto", device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load a local Hugging Face checkpoint in eval mode; never reaches a model hub."""
    path = check_model_dir(path)
    model_class = _skipping_mtp_layers(path)
    model = model_class.from_pretrained(path, dtype=resolve_dtype(dtype, device), local_files_only=True)
    return model.to(device).eval()


def _skipping_mtp_layers(path: str):
    """``AutoModelForCausalLM``, or for a checkpoint with multi-token-prediction layers
    (``num_nextn_predict_layers``, ``specdec.heads.mtp``) its architecture told to skip their
    weights quietly, as transformers' own DeepSeek-V3 class does (``_keys_to_ignore_on_load_unexpected``):
    otherwise every load prints a table of them as unexpected. Any other unexpected or missing key is
    still reported."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    count = raw.get("num_nextn_predict_layers") or 0
    if not count:
        return AutoModelForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    base = AutoModelForCausalLM._model_mapping[type(config)]
    first = config.num_hidden_layers
    mtp_layers = (rf"^model\.layers\.{first + i}\." for i in range(count))  # layers num_hidden_layers + i
    patterns = [*(base._keys_to_ignore_on_load_unexpected or ()), *mtp_layers]
    return type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": patterns, "__module__": base.__module__})


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


class CachedCausalLM:
    """One Hugging Face causal LM serving many sequences, each with its own ``DynamicCache``.

    Calls run one at a time: this is the generic path for any ``AutoModelForCausalLM``;
    the fast engine serves the same contract with one ragged batch per call.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
    ):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_model_len = max_model_len if max_model_len is not None else _config_max_len(model.config)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len is not None:
            check_within_positions(self.max_model_len, _config_max_len(model.config))
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.vocab_size = model_vocab_size(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._caches: dict[str, tuple[DynamicCache, int]] = {}  # each sequence's cache and its length

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        dtype: str = "auto",
        device: str | torch.device = "cpu",
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> CachedCausalLM:
        return cls(load_causal_lm(path, dtype, device), device, max_model_len, max_num_seqs)

    @property
    def num_active_sequences(self) -> int:
        return len(self._caches)

    def cached_length(self, seq_id: str) -> int:
        return self._caches.get(seq_id, (None, 0))[1]

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)

    def forward(self, calls: list[ForwardCall]) -> list[torch.Tensor]:  # each [num_logits, vocab] float32
        """Feed each call's ``token_ids`` at its ``position``, one sequence after another."""
        return self.forward_with_hidden(calls, ())[0]

    @torch.inference_mode()
    def forward_with_hidden(
        self, calls: list[ForwardCall], hidden_layers: tuple[int, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``forward``, and per call ``[len(token_ids), len(hidden_layers) * hidden]``: transformers' own
        ``output_hidden_states`` at those indices (None without ``hidden_layers``)."""
        num_states = getattr(self.model.config, "num_hidden_layers", 0) + 1
        if any(not 0 <= i < num_states for i in hidden_layers):
            raise ValueError(
                f"hidden_layers must be ids in [0, {num_states - 1}] (the target has {num_states - 1} layers), "
                f"got {hidden_layers}"
            )
        check_forward_calls(self, calls, sum(1 for c in calls if c.seq_id not in self._caches))
        trees = [c.seq_id for c in calls if c.tree_parents is not None or c.moves]
        if trees:
            raise ValueError(f"seqs {trees}: draft trees are verified by the fast engine (engine 'fast'); "
                             f"the hf engine verifies chains only")  # fmt: skip
        outs = [self._forward_one(call, hidden_layers) for call in calls]
        return [logits for logits, _ in outs], [hidden for _, hidden in outs]

    def _forward_one(
        self, call: ForwardCall, hidden_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache, length = self._caches.get(call.seq_id, (None, 0))
        if cache is None or call.position == 0:
            cache = DynamicCache()
        elif call.position < length:
            cache.crop(call.position - length)  # a negative count removes that many trailing tokens
        input_ids = torch.tensor([call.token_ids], dtype=torch.long, device=self.device)  # [1, n]
        kwargs = {"logits_to_keep": call.num_logits} if self._logits_to_keep else {}
        if hidden_layers:
            kwargs["output_hidden_states"] = True
        try:
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs)
        except BaseException:
            self.release(call.seq_id)  # a half-updated cache must not be reused
            raise
        self._caches[call.seq_id] = (out.past_key_values, call.position + len(call.token_ids))
        hidden = torch.cat([out.hidden_states[i][0] for i in hidden_layers], -1) if hidden_layers else None
        return out.logits[0, -call.num_logits :].float(), hidden  # [num_logits, vocab], [n, layers * hidden]
