"""Probe: every endpoint fuzzed with hypothesis-generated bodies and headers; no answer may be a 5xx.

Bodies are arbitrary JSON, valid requests with fields swapped for arbitrary values (the fields the
gateway reads and the engine-control ones it must strip), or raw bytes; headers carry arbitrary
bytes in credentials, request and session ids, content type and encoding, SLO and trace headers.
Requests go over a raw socket so any byte reaches the gateway. A valid key is used most of the time,
so bodies that pass validation reach the engines: an engine failing on a client's input would show
as a 502 here.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bench.chaos.common import ADMIN, KEY, MODEL, fuzz_settings, policies, running, start_stack, unexpected_errors

ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/" + MODEL),
    ("GET", "/v1/responses/resp_x"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/admin/status"),
    ("GET", "/admin/backends"),
    ("GET", "/admin/predictor"),
    ("GET", "/admin/predictor/samples"),
    ("POST", "/admin/reload"),
    ("POST", "/v1/chat/completions/../../admin/reload"),
)
MESSAGES = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MESSAGES},
}
FIELDS = (
    "model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
    "stream", "stream_options", "tools", "tool_choice", "user", "metadata", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "stop", "seed", "response_format", "min_tokens", "ignore_eos",
    "priority", "kv_transfer_params", "disaggregated_params", "cache_salt", "dimensions", "encoding_format",
    "best_of", "echo", "logit_bias", "system", "max_output_tokens", "instructions", "previous_response_id",
)  # fmt: skip

OPTIONAL_HEADERS = (
    b"x-request-id", b"x-session-id", b"x-slo-ttft-ms", b"x-slo-tpot-ms", b"traceparent", b"x-tokenway-debug",
    b"x-tokenway-no-fallback", b"Origin", b"Sec-Fetch-Site", b"anthropic-version",
)  # fmt: skip
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
header_bytes = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.sampled_from(("mutated", "mutated", "mutated", "json", "bytes")))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json" or path not in VALID:
        return _json(draw(json_values))
    body = dict(VALID[path])
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(json_values)
    return _json(body)


def _json(value: Any) -> bytes:
    """JSON text of `value`; the standard library's encoder writes integers of any size."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, list[tuple[bytes, bytes]], bytes]:
    method, path = draw(st.sampled_from(ENDPOINTS))
    body = draw(bodies(path)) if method == "POST" else b""
    headers: list[tuple[bytes, bytes]] = []
    auth = draw(st.sampled_from(("key", "key", "key", "admin", "none", "bytes")))
    if auth == "key":
        name = draw(st.sampled_from((b"Authorization", b"x-api-key")))
        headers.append((name, (b"Bearer " if name == b"Authorization" else b"") + KEY.encode()))
    elif auth == "admin":
        headers.append((b"Authorization", b"Bearer " + ADMIN.encode()))
    elif auth == "bytes":
        headers.append((draw(st.sampled_from((b"Authorization", b"x-api-key"))), draw(header_bytes)))
    headers.extend((name, draw(header_bytes)) for name in OPTIONAL_HEADERS if draw(st.integers(0, 5)) == 0)
    content_type = draw(st.sampled_from((b"application/json", b"application/json", b"text/plain", b"")))
    if content_type:
        headers.append((b"Content-Type", content_type))
    encoding = draw(st.sampled_from((None, None, None, b"gzip", b"deflate", b"br", b"identity", b"x-bogus")))
    if encoding is not None:
        headers.append((b"Content-Encoding", encoding))
        if encoding == b"gzip" and draw(st.booleans()):
            body = gzip.compress(body)
    return method, path, headers, body


def _send(port: int, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    head += [name + b": " + value for name, value in headers]
    if method == "POST":
        head.append(b"Content-Length: " + str(len(body)).encode())
    raw = b"\r\n".join(head) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return 0
            data += chunk
        while data.startswith(b"HTTP/1.1 1"):  # interim answers
            rest = data.split(b"\r\n\r\n", 1)
            data = rest[1] if len(rest) == 2 else b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    return 0
                data += chunk
        return int(data.split(b" ", 2)[1])


def run(workdir: Path, *, examples: int = 3000, seed: int | None = None) -> dict[str, Any]:
    stack = start_stack(workdir, engines=2, time_scale=50.0, policy=policies([{"scope": "key", "tpm": 100_000_000}]))
    statuses: dict[int, int] = {}
    server_errors: list[str] = []
    started = time.monotonic()
    with running(stack):

        @fuzz_settings(examples, seed)
        @given(requests())
        def probe(request: tuple[str, str, list[tuple[bytes, bytes]], bytes]) -> None:
            method, path, headers, body = request
            status = _send(stack.gateway.port, method, path, headers, body)
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500 or status == 0:
                server_errors.append(f"{status} {method} {path} {headers!r} {body[:200]!r}"[:600])

        probe()
        log = stack.gateway.log()
    return {
        "examples": sum(statuses.values()),
        "seed": seed,
        "statuses": dict(sorted(statuses.items())),
        "server_errors": len(server_errors),
        "server_error_examples": server_errors[:5],
        "unexpected_in_log": unexpected_errors(log),
        "seconds": round(time.monotonic() - started, 1),
    }
