"""Text <-> token ids for the tokenizer and detokenizer models, over a local Hugging Face tokenizer.

Decoding keeps ``clean_up_tokenization_spaces`` off so that it is prefix-stable,
which streaming relies on (see :mod:`specdec.detokenize`), and the non-streamed
text is decoded the same way, so the two always agree.
"""
from __future__ import annotations

from collections.abc import Sequence

from specdec.tokenizer import eos_token_ids, load_tokenizer
from specdec_triton.plumbing import RequestError


class TextCodec:
    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.eos_token_ids = eos_token_ids(self.tokenizer, tokenizer_dir)

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids as the model saw them in training: with the tokenizer's special tokens (e.g. BOS)."""
        if not text:
            raise RequestError("input 'text_input' must not be empty")
        return list(self.tokenizer(text).input_ids)

    def encode_stop_words(self, words: Sequence[str]) -> list[list[int]]:
        """Each stop word on its own, without special tokens; empty words are ignored."""
        return [list(self.tokenizer(word, add_special_tokens=False).input_ids) for word in words if word]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
