"""A small byte-level BPE tokenizer trained in-process, for tests that need real text <-> ids.

Trained on ASCII only, so every non-ASCII character splits into several byte tokens:
exactly the case streaming detokenization has to get right.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<eos>"
CORPUS = ["the quick brown fox jumps over the lazy dog", "def f(x):\n    return x * 2\n"]


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
