"""Stop strings are matched on the text: the output ends before the first one, and streamed pieces never carry
part of one."""
from __future__ import annotations

import itertools

import pytest

from specdec_openai.stops import StopMatcher, trim_stop


@pytest.mark.parametrize("text, stop, expected", [
    ("hello END", ["END"], "hello "),
    ("hello", ["END"], "hello"),
    ("a\n\nb", ["\n", "\n\n"], "a"),  # the earliest stop string wins
    ("abc", [], "abc"),
    ("one END two END", ["END"], "one "),
    ("xEND.", ["END"], "x"),  # inside what a tokenizer would make one token
])  # fmt: skip
def test_trim_stop(text, stop, expected):
    assert trim_stop(text, stop) == expected


def run(pieces: list[str], stop: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stop)
    sent = [matcher.push(piece) for piece in pieces]
    return sent + [matcher.finish()], matcher.stopped


def test_every_split_of_a_stream_stops_at_the_string_and_sends_no_part_of_it():
    text, stop = "xy STOP and more", ["STOP", "yz"]
    for cut_a, cut_b in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[:cut_a], text[cut_a:cut_b], text[cut_b:]]
        sent, stopped = run(pieces, stop)
        assert "".join(sent) == "xy " and stopped, pieces
        assert all("S" not in piece for piece in sent)  # never sent and then taken back


def test_a_stop_string_across_pieces_is_found_and_nothing_after_it_is_sent():
    sent, stopped = run(["Hello wo", "rld! Bye", " now"], ["world"])
    assert sent == ["Hello ", "", "", ""] and stopped


def test_text_held_back_is_released_when_it_turns_out_not_to_be_a_stop_string():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == "a "
    assert matcher.push("ART") == "START"
    assert matcher.push("STO") == ""
    assert matcher.finish() == "STO" and not matcher.stopped  # the output ended: held text is text
    assert matcher.released == len("a STARTSTO")


def test_before_min_tokens_nothing_is_matched_or_held():
    matcher = StopMatcher(["END"])
    assert matcher.push("an END", active=False) == "an END"
    assert matcher.push(" and END", active=True) == " and " and matcher.stopped
