"""Leave the matched stop string out of the text, as OpenAI's API does.

The Triton model ends its output *after* a stop word and includes it (TensorRT-LLM's
rule); OpenAI's ``stop`` excludes it. Non-streamed, the fix is to cut the stop string
off the end. Streamed, text that may be the start of a stop string is held back until
the next piece shows whether it is one (vLLM holds back the same way), so no piece
ever carries part of a stop string that is cut later.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopTrimmer:
    """Feed it the text pieces in order; it returns what may be sent now, and the rest at the end."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self._held = ""

    def push(self, piece: str) -> str:
        """The part of everything so far that cannot be the start of a stop string."""
        if not self.stop:
            return piece
        text = self._held + piece
        keep = _longest_stop_prefix_suffix(text, self.stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self, finish_reason: str | None) -> str:
        """The held-back text, less a stop string that ended the output."""
        text, self._held = self._held, ""
        if finish_reason == "stop":
            for word in sorted(self.stop, key=len, reverse=True):
                if text.endswith(word):
                    return text[: -len(word)]
        return text


def trim_stop(text: str, stop: Sequence[str], finish_reason: str | None) -> str:
    """Non-streamed: ``text`` less a stop string that ended it."""
    trimmer = StopTrimmer(stop)
    return trimmer.push(text) + trimmer.finish(finish_reason)


def _longest_stop_prefix_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a stop string or the start of one."""
    best = 0
    for word in stop:
        for length in range(min(len(word), len(text)), best, -1):
            if word.startswith(text[len(text) - length :]):
                best = length
                break
    return best
