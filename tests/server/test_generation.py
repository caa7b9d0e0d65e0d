"""A choice's output as the engine loop delivers it: what each streamed chunk may send (text held
back while it might still become a stop string or is half a character), and the version spans the
loop records."""

from __future__ import annotations

from weightsync.serving.hf.base import SamplingParams
from weightsync.serving.hf.generation import Output
from weightsync.serving.hf.loop import TokenEvent, VersionSpan, _Submission


class Bytes:
    """A byte-level tokenizer: token t is byte t, decoded as UTF-8 with replacement characters."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", "replace")


def feed(output: Output, text: bytes, finished_at_end: bool = True) -> list[str]:
    """Deliver `text` one byte-token at a time; the text of each delta."""
    deltas = []
    for position, byte in enumerate(text):
        last = finished_at_end and position == len(text) - 1
        output.add(TokenEvent([byte], None, 1, last, "length" if last else None))
        deltas.append(output.delta().text)
    return deltas


def test_half_a_character_waits_for_the_rest() -> None:
    output = Output(Bytes(), None, 1)
    deltas = feed(output, "aé!".encode())  # é is two bytes
    assert deltas == ["a", "", "é", "!"]


def test_text_that_may_start_a_stop_string_waits_then_goes_out_if_it_does_not() -> None:
    output = Output(Bytes(), ["xyz"], 1)
    deltas = feed(output, b"abxyq")
    assert deltas == ["a", "b", "", "", "xyq"]  # "x", "xy" could begin "xyz"; "xyq" cannot
    assert "".join(deltas) == output.text() == "abxyq"


def test_a_stop_string_ends_the_text_before_it() -> None:
    output = Output(Bytes(), ["xyz"], 1)
    deltas = feed(output, b"abxyz", finished_at_end=False)  # the loop sent no end: the stop string ends it
    assert output.finished and output.finish_reason == "stop"
    assert deltas == ["a", "b", "", "", ""] and output.text() == "ab" and output.token_ids == list(b"abxyz")


def test_the_loop_records_where_each_version_began() -> None:
    submission = _Submission("r", [1], SamplingParams(), lambda event: None)
    assert submission.record(3, 0) == ()  # no tokens: no span
    submission.record(3, 2)
    submission.record(3, 1)
    assert submission.record(None, 1) == (VersionSpan(3, 0, 3),)  # nothing is produced unversioned
    assert submission.record(4, 2) == (VersionSpan(3, 0, 3), VersionSpan(4, 3, 5))
