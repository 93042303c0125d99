"""Incremental detokenization for streaming: the streamed pieces add up to the full text, byte for byte.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character, so
decoding the tokens emitted so far may end in U+FFFD that the next token turns into
a real character. Decoding only the new tokens on their own would freeze that
replacement character (and lose the bytes it stood for) into the stream. Instead,
as in vLLM's and text-generation-inference's incremental decoders, each step decodes
a short window of recent tokens, emits only the part past what was already sent, and
holds back a trailing U+FFFD until either the next token completes it or the output
ends.

This is exact when decoding is *prefix-stable*: the decoded text of a token
sequence, minus any trailing U+FFFD, is a prefix of the decoded text of every
extension of it. Byte-level BPE decoders are, as long as clean-up passes that look
ahead (``clean_up_tokenization_spaces``) are off; :class:`IncrementalDetokenizer`
checks it at the end and fails loudly rather than emit text that the full decode
would not contain.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete or invalid UTF-8 sequence


def stable_text(text: str, final: bool) -> str:
    """The part of ``text`` that later tokens cannot change: all of it once the output is final."""
    return text if final else text.rstrip(REPLACEMENT_CHAR)


class IncrementalDetokenizer:
    """The new text of each step's new tokens, in time proportional to those tokens, not to the output.

    Decoding the whole output at every step would cost O(n^2) over a request. This
    feeds each new token to ``tokenizers``' ``DecodeStream``, which decodes a
    short window of recent tokens (the offset technique of vLLM's and TGI's incremental
    decoders) and holds back a trailing incomplete UTF-8 character, so each step costs
    what its own tokens cost. ``finish`` compares the pieces against one full decode of
    the output, so the stream always concatenates to the non-streamed text byte for byte
    (a trailing U+FFFD that no later token completed comes out there, as in the full
    decode), and a tokenizer whose decode is not prefix-stable fails loudly instead.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """``tokenizer``: a ``tokenizers.Tokenizer`` (a fast Hugging Face tokenizer's ``backend_tokenizer``)."""
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.emitted = ""  # everything returned so far, concatenated

    def push(self, token_ids: list[int]) -> str:
        pieces = [self._stream.step(self._tokenizer, token_id) for token_id in token_ids]
        new = "".join(piece for piece in pieces if piece)
        self.emitted += new
        return new

    def finish(self, full_text: str) -> str:
        """What is left to send once the output is final; ``full_text`` decodes the whole output."""
        if not full_text.startswith(self.emitted):
            raise ValueError(
                "decoding is not prefix-stable: the full decode does not start with the text already "
                f"streamed ({self.emitted[-20:]!r} ...); disable clean_up_tokenization_spaces"
            )
        rest = full_text[len(self.emitted) :]
        self.emitted = full_text
        return rest
