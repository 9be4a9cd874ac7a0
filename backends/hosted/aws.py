"""AWS's wire for Bedrock: the binary event-stream framing of ConverseStream, and SigV4 request
signing with botocore's signer and credential chain.

Event-stream framing
--------------------
The `application/vnd.amazon.eventstream` framing: Bedrock's ConverseStream answer (and its stand-in's).

A message is a 12-byte prelude (total length, headers length, CRC32 of those 8 bytes), typed
headers, the payload and a CRC32 of everything before it. The decoder is incremental because
frames arrive split across network reads, and checks both CRCs: a corrupt frame is an error, never
a silently wrong token. The encoder exists for the stand-in (and tests): the same code both ways
keeps the two sides from agreeing on a private dialect, which is why the stand-in is also checked
with botocore's own parser.

SigV4 signing
-------------
AWS Signature Version 4 for Bedrock calls, with botocore's signer and credential chain.

Signing is cheap and pure (HMACs over the exact bytes the codec produced), so it runs per request
on the event loop. Finding credentials is not: botocore's chain (environment, shared profile,
SSO, container or instance role through IMDS) may read files and make HTTP calls that block for
seconds, so `CredentialSource.refresh` is meant to run off the loop (`asyncio.to_thread`) at
start-up and again before `expires_in_s` runs out, never per request; requests sign with the
frozen credentials it returned last.

`verify` recomputes a received request's signature with the same signer: the Bedrock stand-in
uses it to refuse unsigned and mis-signed calls as the real service does.

botocore is optional (`pip install 'tokenway[bedrock]'`): it is imported when first used.
"""

from __future__ import annotations

import datetime
import hmac
import re
import struct
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from backends.hosted.base import UpstreamCall

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


__all__ = ["AwsCredentials", "CredentialSource", "SigV4Error", "sign", "verify"]

SERVICE = "bedrock"
_TIMESTAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=(?P<akid>[^/,\s]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)"
    r"/aws4_request,\s*SignedHeaders=(?P<signed>[a-z0-9;._-]+),\s*Signature=(?P<sig>[0-9a-f]{64})$"
)


class SigV4Error(RuntimeError):
    """No credentials could be found, or botocore is not installed."""


def _botocore() -> Any:
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.credentials
        import botocore.session
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SigV4Error("Bedrock pools need botocore: pip install 'tokenway[bedrock]'") from exc
    return botocore


@dataclass(frozen=True, slots=True)
class AwsCredentials:
    """Frozen credentials: what a request is signed with until the next refresh."""

    access_key: str
    secret_key: str
    token: str | None = None
    expires_at: datetime.datetime | None = None  # None: static credentials


class CredentialSource:
    """botocore's credential chain for one profile; `refresh` blocks (run it off the event loop)."""

    def __init__(self, profile: str | None = None) -> None:
        self.profile = profile
        self._credentials: Any = None

    def refresh(self) -> AwsCredentials:
        """Resolve (first call) or refresh the chain's credentials; may block on files and IMDS."""
        botocore = _botocore()
        if self._credentials is None:
            session = botocore.session.Session(profile=self.profile)
            self._credentials = session.get_credentials()
            if self._credentials is None:
                raise SigV4Error("no AWS credentials found (environment, profile or role)")
        frozen = self._credentials.get_frozen_credentials()  # refreshes when close to expiry
        expiry = getattr(self._credentials, "_expiry_time", None)
        return AwsCredentials(frozen.access_key, frozen.secret_key, frozen.token, expiry)

    @staticmethod
    def expires_in_s(credentials: AwsCredentials, now: datetime.datetime | None = None) -> float | None:
        """Seconds until `credentials` expire (None for static ones): refresh well before this."""
        if credentials.expires_at is None:
            return None
        now = now or datetime.datetime.now(datetime.UTC)
        return (credentials.expires_at - now).total_seconds()


class _Signer:
    """botocore's SigV4Auth with the timestamp and the signed header list given, not taken from the clock."""

    def __init__(self, credentials: AwsCredentials, region: str, service: str) -> None:
        botocore = _botocore()
        creds = botocore.credentials.ReadOnlyCredentials(
            credentials.access_key, credentials.secret_key, credentials.token
        )
        self.auth = botocore.auth.SigV4Auth(creds, service, region)
        self.botocore = botocore

    def request(self, method: str, url: str, headers: Mapping[str, str], body: bytes, timestamp: str) -> Any:
        request = self.botocore.awsrequest.AWSRequest(method=method, url=url, headers=dict(headers), data=body)
        request.context["timestamp"] = timestamp
        return request

    def signature(self, request: Any) -> tuple[str, str]:
        """(signature, signed header list) of a request whose headers are exactly the signed ones."""
        canonical = self.auth.canonical_request(request)
        string_to_sign = self.auth.string_to_sign(request, canonical)
        signed = self.auth.signed_headers(self.auth.headers_to_sign(request))
        return str(self.auth.signature(string_to_sign, request)), str(signed)


def sign(
    call: UpstreamCall,
    base_url: str,
    credentials: AwsCredentials,
    region: str,
    *,
    service: str = SERVICE,
    now: datetime.datetime | None = None,
) -> UpstreamCall:
    """`call` with `x-amz-date`, `x-amz-security-token` (temporary credentials) and `authorization` added.

    Every header of the call and `host` are signed, so the transport must send exactly these
    (headers its HTTP client adds on its own, like `accept-encoding`, are outside the signature),
    and the path exactly as given: yarl decodes `%3A` in a model id to `:` unless the URL is built
    with `encoded=True`, and AWS then computes another signature.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    timestamp = now.strftime(_TIMESTAMP_FORMAT)
    url = base_url.rstrip("/") + call.path
    headers = {k.lower(): v for k, v in call.headers if k.lower() not in ("authorization", "x-amz-date")}
    headers["host"] = urlsplit(url).netloc
    headers["x-amz-date"] = timestamp
    if credentials.token:
        headers["x-amz-security-token"] = credentials.token
    signer = _Signer(credentials, region, service)
    request = signer.request(call.method, url, headers, call.body, timestamp)
    signature, signed = signer.signature(request)
    scope = f"{credentials.access_key}/{timestamp[:8]}/{region}/{service}/aws4_request"
    headers["authorization"] = f"AWS4-HMAC-SHA256 Credential={scope}, SignedHeaders={signed}, Signature={signature}"
    del headers["host"]  # the HTTP client sends it from the URL
    return replace(call, headers=tuple(headers.items()))


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why a request's signature was refused (None when it checks), as AWS names it."""

    error: str | None  # MissingAuthenticationTokenException, IncompleteSignatureException, ...
    message: str = ""
    access_key: str = ""


def verify(
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
    secret_for: Callable[[str], str | None],
    *,
    service: str = SERVICE,
    now: datetime.datetime | None = None,
    max_skew_s: float = 300.0,
) -> Verdict:
    """Recompute the SigV4 signature of a received request (`url` with its raw, still-encoded path)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    auth = lowered.get("authorization")
    if not auth:
        return Verdict("MissingAuthenticationTokenException", "Missing Authentication Token")
    match = _AUTH.match(auth.strip())
    if match is None:
        return Verdict("IncompleteSignatureException", "Authorization header is not a SigV4 signature")
    timestamp = lowered.get("x-amz-date", "")
    try:
        signed_at = datetime.datetime.strptime(timestamp, _TIMESTAMP_FORMAT).replace(tzinfo=datetime.UTC)
    except ValueError:
        return Verdict("IncompleteSignatureException", "x-amz-date is missing or malformed")
    if match["date"] != timestamp[:8] or match["service"] != service:
        return Verdict("InvalidSignatureException", "Credential scope does not match the date or service")
    now = now or datetime.datetime.now(datetime.UTC)
    if abs((now - signed_at).total_seconds()) > max_skew_s:
        return Verdict("InvalidSignatureException", "Signature expired: x-amz-date is too far from now")
    secret = secret_for(match["akid"])
    if secret is None:
        return Verdict("UnrecognizedClientException", "The security token included in the request is invalid.")
    names = match["signed"].split(";")
    if "host" not in names:
        return Verdict("IncompleteSignatureException", "host must be a signed header")
    missing = [n for n in names if n not in lowered]
    if missing:
        return Verdict("IncompleteSignatureException", f"signed headers missing from the request: {missing}")
    signed_headers = {n: lowered[n] for n in names}
    credentials = AwsCredentials(match["akid"], secret, lowered.get("x-amz-security-token"))
    signer = _Signer(credentials, match["region"], service)
    request = signer.request(method, url, signed_headers, body, timestamp)
    expected, _ = signer.signature(request)
    if not hmac.compare_digest(expected, match["sig"]):
        return Verdict(
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided.",
            match["akid"],
        )
    return Verdict(None, "", match["akid"])
