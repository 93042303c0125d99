"""A checkpoint's tokenizer and its end-of-sequence ids, without the models.

Kept apart from :mod:`specdec.models` so that a process that only turns text into ids
(the tokenizer and detokenizer models, the OpenAI server) does not import the
transformers modeling code, which takes seconds on a small machine.
"""
from __future__ import annotations

import json
import os

from transformers import AutoTokenizer

from specdec.cached_lm import check_model_dir


def load_tokenizer(path: str | os.PathLike):
    return AutoTokenizer.from_pretrained(check_model_dir(path), local_files_only=True)


def eos_token_ids(tokenizer, tokenizer_dir: str | os.PathLike) -> list[int]:
    """The tokenizer's EOS plus any in ``generation_config.json``: what Hugging Face ``generate`` stops on."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    path = os.path.join(tokenizer_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
    return list(dict.fromkeys(ids))
