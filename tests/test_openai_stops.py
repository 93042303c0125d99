"""Stop strings are left out of OpenAI text, and streamed pieces never carry one that is cut later."""
from __future__ import annotations

import itertools

import pytest

from specdec_openai.stops import StopTrimmer, trim_stop


@pytest.mark.parametrize("text, stop, reason, expected", [
    ("hello END", ["END"], "stop", "hello "),
    ("hello END", ["END"], "length", "hello END"),  # cut short by max_tokens: no stop string matched
    ("a\n\n", ["\n", "\n\n"], "stop", "a"),  # the longest match is cut
    ("abc", [], "stop", "abc"),
    ("END in the middle END", ["END"], "stop", "END in the middle "),
])  # fmt: skip
def test_trim_stop(text, stop, reason, expected):
    assert trim_stop(text, stop, reason) == expected


def test_every_split_of_a_stream_gives_the_trimmed_text_and_sends_no_stop_prefix_early():
    text, stop = "xy STOP", ["STOP", "yz"]
    for cut_a, cut_b in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[:cut_a], text[cut_a:cut_b], text[cut_b:]]
        trimmer = StopTrimmer(stop)
        sent = [trimmer.push(piece) for piece in pieces]
        assert "".join(sent) + trimmer.finish("stop") == "xy ", pieces
        assert "S" not in "".join(sent)  # never sent and then taken back


def test_text_held_back_is_released_when_it_turns_out_not_to_be_a_stop_string():
    trimmer = StopTrimmer(["STOP"])
    assert trimmer.push("a ST") == "a "
    assert trimmer.push("ART") == "START"
    assert trimmer.finish("length") == ""
