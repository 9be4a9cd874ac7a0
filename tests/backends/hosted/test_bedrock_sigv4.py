"""SigV4 for Bedrock: what `sign` produces verifies, any change to what was signed does not, and
botocore's own signer (as boto3 uses it) agrees with `verify`."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from backends.hosted.aws import AwsCredentials, CredentialSource, sign, verify
from backends.hosted.base import UpstreamCall

BASE = "http://127.0.0.1:20001"
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
CREDS = AwsCredentials("AKIDEXAMPLE", "secret-key")
CALL = UpstreamCall(
    method="POST",
    path="/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
    headers=(("content-type", "application/json"),),
    body=b'{"messages":[]}',
    stream=False,
)


def _received(call: UpstreamCall) -> dict[str, str]:
    """The headers as the server sees them (the HTTP client adds `host` from the URL)."""
    return {**dict(call.headers), "host": "127.0.0.1:20001"}


def _check(
    call: UpstreamCall, *, body: bytes | None = None, path: str | None = None, extra: dict[str, str] | None = None
) -> str | None:
    headers = _received(call)
    headers.update(extra or {})
    secrets = {"AKIDEXAMPLE": "secret-key"}
    verdict = verify(
        call.method, BASE + (path or call.path), headers, call.body if body is None else body, secrets.get, now=NOW
    )
    return verdict.error


def test_a_signed_call_verifies() -> None:
    signed = sign(CALL, BASE, CREDS, "us-east-1", now=NOW)
    headers = dict(signed.headers)
    assert headers["x-amz-date"] == "20260102T030405Z"
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20260102/us-east-1/bedrock/")
    assert signed.body == CALL.body and signed.path == CALL.path
    assert _check(signed) is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"body": b'{"messages":[1]}'}, "InvalidSignatureException"),
        ({"path": "/model/other/converse"}, "InvalidSignatureException"),
        ({"content-type": "text/plain"}, "InvalidSignatureException"),
        ({"authorization": ""}, "MissingAuthenticationTokenException"),
        ({"authorization": "Bearer nope"}, "IncompleteSignatureException"),
    ],
)
def test_any_change_to_what_was_signed_is_refused(change: dict[str, Any], error: str) -> None:
    signed = sign(CALL, BASE, CREDS, "us-east-1", now=NOW)
    change = dict(change)
    body = change.pop("body", None)
    path = change.pop("path", None)
    assert _check(signed, body=body, path=path, extra=change) == error


def test_a_wrong_secret_an_unknown_key_and_a_stale_date_are_refused() -> None:
    wrong = sign(CALL, BASE, AwsCredentials("AKIDEXAMPLE", "guess"), "us-east-1", now=NOW)
    assert _check(wrong) == "InvalidSignatureException"
    stranger = sign(CALL, BASE, AwsCredentials("AKIDOTHER", "secret-key"), "us-east-1", now=NOW)
    assert _check(stranger) == "UnrecognizedClientException"
    stale = sign(CALL, BASE, CREDS, "us-east-1", now=NOW - datetime.timedelta(minutes=20))
    assert _check(stale) == "InvalidSignatureException"


def test_temporary_credentials_sign_their_session_token() -> None:
    signed = sign(CALL, BASE, AwsCredentials("AKIDEXAMPLE", "secret-key", "session-token"), "us-east-1", now=NOW)
    headers = dict(signed.headers)
    assert headers["x-amz-security-token"] == "session-token"
    assert "x-amz-security-token" in headers["authorization"]
    assert _check(signed) is None
    assert _check(signed, extra={"x-amz-security-token": "another"}) == "InvalidSignatureException"


def test_verify_accepts_what_botocores_own_signer_signs() -> None:
    request = AWSRequest(
        method="POST", url=BASE + CALL.path, data=CALL.body, headers={"Content-Type": "application/json"}
    )
    SigV4Auth(Credentials("AKIDEXAMPLE", "secret-key"), "bedrock", "eu-west-1").add_auth(request)
    headers = {k: v for k, v in request.headers.items()}
    headers["host"] = "127.0.0.1:20001"
    verdict = verify("POST", BASE + CALL.path, headers, CALL.body, {"AKIDEXAMPLE": "secret-key"}.get)
    assert verdict.error is None and verdict.access_key == "AKIDEXAMPLE"


def test_the_credential_chain_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-token")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    credentials = CredentialSource().refresh()
    assert credentials == AwsCredentials("AKIDFROMENV", "env-secret", "env-token", None)
    assert CredentialSource.expires_in_s(credentials) is None


def test_the_credential_chain_reads_a_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    shared = tmp_path / "credentials"
    shared.write_text("[work]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = profile-secret\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    credentials = CredentialSource(profile="work").refresh()
    assert (credentials.access_key, credentials.secret_key) == ("AKIDPROFILE", "profile-secret")
