"""The `application/vnd.amazon.eventstream` framing: Bedrock's ConverseStream answer (and its stand-in's).

A message is a 12-byte prelude (total length, headers length, CRC32 of those 8 bytes), typed
headers, the payload and a CRC32 of everything before it. The decoder is incremental because
frames arrive split across network reads, and checks both CRCs: a corrupt frame is an error, never
a silently wrong token. The encoder exists for the stand-in (and tests): the same code both ways
keeps the two sides from agreeing on a private dialect, which is why the stand-in is also checked
with botocore's own parser.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

_PRELUDE = struct.Struct(">III")
_PRELUDE_LEN = 12
_CRC_LEN = 4
# Frames larger than this are refused as corrupt (the service's own cap is 16 MiB per message).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024 + 1024

HeaderValue = bool | int | bytes | str | uuid.UUID

# value type codes
_TRUE, _FALSE, _BYTE, _SHORT, _INT, _LONG, _BYTES, _STRING, _TIMESTAMP, _UUID = range(10)


class EventStreamError(ValueError):
    """A frame that fails its checks (bad CRC, impossible lengths, unknown header type)."""


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One decoded frame: its headers (`:event-type`, `:message-type`, ...) and raw payload."""

    headers: dict[str, HeaderValue]
    payload: bytes

    @property
    def message_type(self) -> str:
        return str(self.headers.get(":message-type", "event"))

    @property
    def event_type(self) -> str | None:
        """The event's name, or for an exception frame the exception's (`throttlingException`, ...)."""
        name = self.headers.get(":event-type")
        if name is None:
            name = self.headers.get(":exception-type")
        if name is None:
            name = self.headers.get(":error-code")
        return None if name is None else str(name)


def _encode_header(name: str, value: HeaderValue) -> bytes:
    raw_name = name.encode()
    if len(raw_name) > 255:
        raise EventStreamError(f"header name too long: {name!r}")
    out = bytes([len(raw_name)]) + raw_name
    if value is True:
        return out + bytes([_TRUE])
    if value is False:
        return out + bytes([_FALSE])
    if isinstance(value, int):
        return out + bytes([_LONG]) + struct.pack(">q", value)
    if isinstance(value, uuid.UUID):
        return out + bytes([_UUID]) + value.bytes
    if isinstance(value, str):
        data = value.encode()
        return out + bytes([_STRING]) + struct.pack(">H", len(data)) + data
    return out + bytes([_BYTES]) + struct.pack(">H", len(value)) + bytes(value)


def encode_message(headers: Mapping[str, HeaderValue], payload: bytes) -> bytes:
    """One frame (strings as string headers, ints as 64-bit longs)."""
    raw_headers = b"".join(_encode_header(k, v) for k, v in headers.items())
    total = _PRELUDE_LEN + len(raw_headers) + len(payload) + _CRC_LEN
    prelude = struct.pack(">II", total, len(raw_headers))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    body = prelude + raw_headers + payload
    return body + struct.pack(">I", zlib.crc32(body))


def encode_event(event_type: str, payload: bytes, content_type: str = "application/json") -> bytes:
    """An `event` frame as AWS services send them (`:event-type`, `:content-type`, `:message-type`)."""
    return encode_message({":event-type": event_type, ":content-type": content_type, ":message-type": "event"}, payload)


def encode_exception(exception_type: str, payload: bytes) -> bytes:
    """An `exception` frame: a modelled error in the middle of a stream (`throttlingException`, ...)."""
    return encode_message(
        {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"},
        payload,
    )


def _decode_headers(raw: bytes) -> dict[str, HeaderValue]:
    headers: dict[str, HeaderValue] = {}
    pos = 0
    end = len(raw)
    try:
        while pos < end:
            name_len = raw[pos]
            pos += 1
            name = raw[pos : pos + name_len].decode()
            pos += name_len
            kind = raw[pos]
            pos += 1
            value: HeaderValue
            if kind == _TRUE:
                value = True
            elif kind == _FALSE:
                value = False
            elif kind == _BYTE:
                value = struct.unpack_from(">b", raw, pos)[0]
                pos += 1
            elif kind == _SHORT:
                value = struct.unpack_from(">h", raw, pos)[0]
                pos += 2
            elif kind == _INT:
                value = struct.unpack_from(">i", raw, pos)[0]
                pos += 4
            elif kind in (_LONG, _TIMESTAMP):
                value = struct.unpack_from(">q", raw, pos)[0]
                pos += 8
            elif kind in (_BYTES, _STRING):
                (length,) = struct.unpack_from(">H", raw, pos)
                pos += 2
                data = raw[pos : pos + length]
                if len(data) != length:
                    raise EventStreamError("header value runs past the headers")
                pos += length
                value = data.decode() if kind == _STRING else bytes(data)
            elif kind == _UUID:
                data = raw[pos : pos + 16]
                if len(data) != 16:
                    raise EventStreamError("uuid header value runs past the headers")
                value = uuid.UUID(bytes=bytes(data))
                pos += 16
            else:
                raise EventStreamError(f"unknown header value type {kind}")
            headers[name] = value
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise EventStreamError(f"malformed headers: {exc}") from exc
    if pos != end:
        raise EventStreamError("header values run past the headers")
    return headers


class EventStreamDecoder:
    """Bytes in (any split), whole checked messages out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[EventMessage]:
        self._buffer += data
        out: list[EventMessage] = []
        while len(self._buffer) >= _PRELUDE_LEN:
            total, headers_len, prelude_crc = _PRELUDE.unpack_from(self._buffer, 0)
            if zlib.crc32(bytes(self._buffer[:8])) != prelude_crc:
                raise EventStreamError("prelude CRC mismatch")
            if total < _PRELUDE_LEN + _CRC_LEN + headers_len or total > MAX_MESSAGE_BYTES:
                raise EventStreamError(f"impossible message length {total} (headers {headers_len})")
            if len(self._buffer) < total:
                break
            frame = bytes(self._buffer[:total])
            del self._buffer[:total]
            (message_crc,) = struct.unpack_from(">I", frame, total - _CRC_LEN)
            if zlib.crc32(frame[: total - _CRC_LEN]) != message_crc:
                raise EventStreamError("message CRC mismatch")
            headers = _decode_headers(frame[_PRELUDE_LEN : _PRELUDE_LEN + headers_len])
            out.append(EventMessage(headers, frame[_PRELUDE_LEN + headers_len : total - _CRC_LEN]))
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back (a stream that ends with some is truncated)."""
        return len(self._buffer)
