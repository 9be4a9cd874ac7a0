"""Server-sent events out of an upstream's byte stream (`backends.types.EventBuffer`): every whole event
once however the stream is split, CR LF read as LF where providers write it, and an event without its
end bounded, read in linear time (an engine's answer is input: one endless event must cost neither
memory without bound nor the event loop quadratic time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.types import EventBuffer, EventTooLarge

EVENTS = [b'data: {"i": %d}' % i for i in range(40)] + [b"event: x\ndata: y", b": comment"]
STREAM = b"\n\n".join(EVENTS) + b"\n\ndata: tail"


def fed(buffer: EventBuffer, data: bytes, cuts: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(data)], strict=True):
        out += buffer.feed(data[start:end])
    return out


@settings(max_examples=300, database=None, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=60), st.booleans())
def test_every_event_once_however_the_stream_is_split(cuts: list[int], crlf: bool) -> None:
    data = STREAM.replace(b"\n", b"\r\n") if crlf else STREAM
    buffer = EventBuffer(crlf=crlf)
    assert fed(buffer, data, cuts) == EVENTS
    assert buffer.rest() == b"data: tail" and buffer.rest() == b""


def test_an_event_without_its_end_is_bounded() -> None:
    buffer = EventBuffer(max_bytes=1000)
    with pytest.raises(EventTooLarge):
        for _ in range(200):
            buffer.feed(b"data: " + b"x" * 10)
    assert buffer.feed(b"data: next\n\n") == [b"data: next"]  # what it held was dropped


def test_a_chunk_without_a_separator_is_not_joined_until_one_comes() -> None:
    """The linear reading: parts wait as they came, and a separator split between two chunks is found."""
    buffer = EventBuffer()
    assert buffer.feed(b"data: a") == [] and buffer.feed(b"b\n") == []
    assert buffer.feed(b"\ndata: c") == [b"data: ab"]
    assert buffer.rest() == b"data: c"
