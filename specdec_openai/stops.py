"""Stop strings matched on the output text, as OpenAI's API and vLLM match them.

A stop string may span tokens, or be merged by the tokenizer with its neighbours
(``"END"`` inside ``"xEND."``), so it is looked for in the text, not in the tokens:
the output ends where the first stop string begins, and the stop string is left out.
Streamed, text that may be the start of a stop string is held back until the next
piece shows whether it is one (vLLM holds back the same way), so no piece ever
carries part of a stop string; once it cannot be, it is released.

Matching starts once the output is longer than ``min_tokens``, as the Triton model's
own stop checks do: before, every piece is released whole.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed it the text pieces in order; it returns what may be sent now, and the rest at the end.

    ``stopped`` turns true on the piece that completes a stop string; that call returns
    the text before it, and every later call returns nothing.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.stopped = False
        self.released = 0  # characters of the output returned so far
        self._held = ""

    def push(self, piece: str, active: bool = True) -> str:
        """The part of everything so far that cannot be (the start of) a stop string; ``active`` false: all of it."""
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stop or not active:
            return self._release(text, "")
        cut = first_stop(text, self.stop)
        if cut is not None:
            self.stopped = True
            return self._release(text[:cut], "")
        keep = _longest_stop_prefix_suffix(text, self.stop)
        return self._release(text[: len(text) - keep], text[len(text) - keep :])

    def finish(self) -> str:
        """The held-back text: the output ended without completing a stop string."""
        return self._release(self._held, "")

    def _release(self, text: str, held: str) -> str:
        self._held = held
        self.released += len(text)
        return text


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string in ``text`` begins; None if there is none."""
    found = [at for at in (text.find(word) for word in stop) if at >= 0]
    return min(found) if found else None


def trim_stop(text: str, stop: Sequence[str]) -> str:
    """Non-streamed: ``text`` up to its first stop string."""
    cut = first_stop(text, stop)
    return text if cut is None else text[:cut]


def _longest_stop_prefix_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (a whole one is found before)."""
    best = 0
    for word in stop:
        for length in range(min(len(word) - 1, len(text)), best, -1):
            if word.startswith(text[len(text) - length :]):
                best = length
                break
    return best
