"""In-process Hugging Face ``generate`` on the same checkpoints: the reference points.

Three modes, each greedy with one request at a time (assisted generation in
``transformers`` takes batch size 1):

* ``plain`` -- autoregressive decoding;
* ``assisted`` -- ``assistant_model`` = the draft, exactly ``k`` drafts per step
  (``num_assistant_tokens = k``, schedule ``"constant"``, and
  ``assistant_confidence_threshold = 0`` so the draft never stops early; set on the
  draft's own ``generation_config``, which is where ``generate`` reads them);
* ``prompt_lookup`` -- ``prompt_lookup_num_tokens = k`` (n-gram matching in the prompt).

A streamer records when each step's tokens arrive, so the same TTFT / ITL figures as
for the server apply; ``generate`` hands the streamer one step's tokens at a time,
so tokens per chunk is the mean accepted length.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from bench.stats import RequestTiming
from bench.workload import Prompt

MODES = ("plain", "assisted", "prompt_lookup")


class _TimingStreamer(BaseStreamer):
    """Records arrival times; the first ``put`` is the prompt and is skipped."""

    def __init__(self, timing: RequestTiming):
        self.timing = timing
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.timing.record(now, int(value.numel()))

    def end(self) -> None:
        pass


def generation_config(max_tokens: int, eos_token_id: int | list[int] | None, ignore_eos: bool) -> GenerationConfig:
    """Greedy ``generate`` settings; ``eos_token_id``: one id or all of a model's (all are banned under ``ignore_eos``)."""
    ids = eos_token_id if isinstance(eos_token_id, list) else [] if eos_token_id is None else [eos_token_id]
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens if ignore_eos else 0,
        eos_token_id=(ids if isinstance(eos_token_id, list) else ids[0]) if ids else None,
        pad_token_id=ids[0] if ids else 0,
    )


def run_hf(
    target: PreTrainedModel,
    prompts: list[Prompt],
    config: GenerationConfig,
    mode: str,
    k: int = 0,
    draft: PreTrainedModel | None = None,
) -> Iterator[tuple[RequestTiming, list[int]]]:
    """Generate for each prompt in turn, yielding each request's timing and output ids as it finishes."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    kwargs: dict = {}
    config = copy.deepcopy(config)
    if mode == "assisted":
        if draft is None or k < 1:
            raise ValueError("mode 'assisted' needs a draft model and k >= 1")
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    elif mode == "prompt_lookup":
        if k < 1:
            raise ValueError("mode 'prompt_lookup' needs k >= 1")
        config.prompt_lookup_num_tokens = k
    device = next(target.parameters()).device
    for prompt in prompts:
        input_ids = torch.tensor([prompt.token_ids], device=device)  # [1, prompt_len]
        timing = RequestTiming(sent=time.perf_counter())
        with torch.inference_mode():
            out = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                streamer=_TimingStreamer(timing),
                **kwargs,
            )
        yield timing, out[0, input_ids.shape[1] :].tolist()
