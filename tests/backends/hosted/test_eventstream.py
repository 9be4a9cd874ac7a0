"""The eventstream framing: our frames read by botocore's own parser, split reads, and corrupt frames refused."""

from __future__ import annotations

import struct
import uuid

import pytest
from botocore.eventstream import EventStreamBuffer

from backends.hosted.aws import (
    EventStreamDecoder,
    EventStreamError,
    encode_event,
    encode_exception,
    encode_message,
)


def test_botocore_reads_the_frames_we_encode() -> None:
    frames = encode_event("contentBlockDelta", b'{"delta":{"text":"hi"}}') + encode_exception(
        "throttlingException", b'{"message":"slow down"}'
    )
    buffer = EventStreamBuffer()
    buffer.add_data(frames)
    messages = list(buffer)
    assert [m.headers[":message-type"] for m in messages] == ["event", "exception"]
    assert messages[0].headers[":event-type"] == "contentBlockDelta"
    assert messages[0].payload == b'{"delta":{"text":"hi"}}'
    assert messages[1].headers[":exception-type"] == "throttlingException"


def test_every_header_type_round_trips() -> None:
    value = uuid.UUID(int=7)
    frame = encode_message({"t": True, "f": False, "n": -5, "s": "text", "b": b"\x00\x01", "u": value}, b"body")
    (message,) = EventStreamDecoder().feed(frame)
    assert message.headers == {"t": True, "f": False, "n": -5, "s": "text", "b": b"\x00\x01", "u": value}
    assert message.payload == b"body"


def test_frames_split_at_every_byte_come_out_whole() -> None:
    data = b"".join(encode_event(f"e{i}", b"x" * i) for i in range(5))
    decoder = EventStreamDecoder()
    messages = []
    for i in range(len(data)):
        messages.extend(decoder.feed(data[i : i + 1]))
    assert [m.event_type for m in messages] == ["e0", "e1", "e2", "e3", "e4"]
    assert [len(m.payload) for m in messages] == [0, 1, 2, 3, 4]
    assert decoder.pending == 0


def test_a_truncated_frame_is_held_back() -> None:
    frame = encode_event("messageStop", b"{}")
    decoder = EventStreamDecoder()
    assert decoder.feed(frame[:-3]) == []
    assert decoder.pending == len(frame) - 3


def test_a_corrupt_payload_fails_the_message_crc() -> None:
    frame = bytearray(encode_event("contentBlockDelta", b'{"delta":{"text":"hi"}}'))
    frame[-6] ^= 0xFF
    with pytest.raises(EventStreamError, match="message CRC"):
        EventStreamDecoder().feed(bytes(frame))


def test_a_corrupt_prelude_is_refused_before_waiting_for_its_length() -> None:
    frame = bytearray(encode_event("x", b"{}"))
    frame[0:4] = struct.pack(">I", 1 << 30)  # an absurd length, and the prelude CRC no longer matches
    with pytest.raises(EventStreamError, match="prelude CRC"):
        EventStreamDecoder().feed(bytes(frame))
