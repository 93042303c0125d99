"""Streaming detokenization (specdec.detokenize): the streamed pieces concatenate to the full decode."""
from __future__ import annotations

import pytest
from byte_tokenizer import byte_level_tokenizer

from specdec.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer, stable_text

TEXTS = ["Grüße aus München", "東京は日本の首都です", "emoji 🚀🔥✨ end", "plain ascii only", "mixed: ça 中 🚀!"]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream_pieces(tokenizer, ids, step: int) -> list[str]:
    """Stream ``ids`` ``step`` tokens at a time; the last piece is what ``finish`` adds."""
    stream = IncrementalDetokenizer(tokenizer.backend_tokenizer)
    pieces = [stream.push(ids[start : start + step]) for start in range(0, len(ids), step)]
    return pieces + [stream.finish(decode(tokenizer, ids))]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_streamed_pieces_concatenate_to_the_full_decode(tokenizer, text, step):
    ids = tokenizer(text).input_ids
    pieces = stream_pieces(tokenizer, ids, step)
    assert "".join(pieces) == decode(tokenizer, ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_characters_really_are_split_across_tokens(tokenizer):
    """The case under test occurs: decoding tokens one by one would corrupt the text."""
    ids = tokenizer("東京").input_ids
    naive = "".join(decode(tokenizer, [t]) for t in ids)
    assert naive != "東京" and REPLACEMENT_CHAR in naive
    assert "".join(stream_pieces(tokenizer, ids, 1)) == "東京"


def test_invalid_bytes_are_held_back_then_emitted(tokenizer):
    """A real U+FFFD (an invalid byte) is only held while it trails, and ends up in the stream."""
    invalid = tokenizer.convert_tokens_to_ids(["ÿ"])  # the byte 0xFF, never valid UTF-8
    ids = tokenizer("ab").input_ids + invalid + tokenizer("cd").input_ids
    pieces = stream_pieces(tokenizer, ids, 1)
    assert "".join(pieces) == decode(tokenizer, ids) == "ab" + REPLACEMENT_CHAR + "cd"
    trailing = stream_pieces(tokenizer, tokenizer("ab").input_ids + invalid, 1)
    assert trailing[-1] == REPLACEMENT_CHAR  # only the final decode has it


def test_special_tokens_are_skipped_as_in_the_full_decode(tokenizer):
    ids = tokenizer("ab").input_ids + [tokenizer.eos_token_id] + tokenizer("cd").input_ids
    assert "".join(stream_pieces(tokenizer, ids, 1)) == decode(tokenizer, ids) == "abcd"


def test_stable_text_holds_back_only_a_trailing_replacement_char():
    assert stable_text("ab\ufffd", final=False) == "ab"
    assert stable_text("ab\ufffd", final=True) == "ab\ufffd"
    assert stable_text("a\ufffdb", final=False) == "a\ufffdb"


def test_a_decoder_that_rewrites_earlier_text_is_refused(tokenizer):
    stream = IncrementalDetokenizer(tokenizer.backend_tokenizer)
    stream.push(tokenizer("hello ").input_ids)
    with pytest.raises(ValueError, match="not prefix-stable"):
        stream.finish("hello.")  # e.g. clean_up_tokenization_spaces turning " ." into "."
