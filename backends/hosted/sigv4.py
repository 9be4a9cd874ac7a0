"""AWS Signature Version 4 for Bedrock calls, with botocore's signer and credential chain.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from backends.hosted.base import UpstreamCall

__all__ = ["AwsCredentials", "CredentialSource", "SigV4Error", "sign", "verify"]

SERVICE = "bedrock"
_TIMESTAMP = "%Y%m%dT%H%M%SZ"
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
    timestamp = now.strftime(_TIMESTAMP)
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
        signed_at = datetime.datetime.strptime(timestamp, _TIMESTAMP).replace(tzinfo=datetime.UTC)
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
