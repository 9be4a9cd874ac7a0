"""The Files and Batch APIs through real gateway processes and simulated engines, with the official
`openai` client: files round trip, broken lines, oversized files, another key's ids, batches end to
end across a kill -9 and a graceful restart, cancel, pagination, the batch price and rate limits,
and two replicas sharing Redis (one killed mid-batch)."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from policies.policy import hash_key
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    running,
    start_gateway,
    start_sim,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "llama-3.1-8b"
LIMITED_KEY = "sk-batch-limited-0000"
RATED_KEY = "sk-batch-rated-0000"  # rpm 2, and nothing else
FINISHED = ("completed", "failed", "expired", "cancelled")


def policies(**extra: Any) -> dict[str, Any]:
    return {
        "tenants": {"t1": {}, "t2": {}, "slow": {}, "rated": {}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "slow", "sha256": hash_key(LIMITED_KEY)},
            {"id": "k4", "tenant": "rated", "sha256": hash_key(RATED_KEY)},
        ],
        "models": {MODEL: {"context_length": 16384, "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}},
        "limits": [
            {"scope": "key", "match": {"key": "k3"}, "max_concurrent": 1},
            {"scope": "key", "match": {"key": "k4"}, "rpm": 2},
        ],
        "batch": {"price_factor": 0.5},
        **extra,
    }


def pools(urls: list[str]) -> list[dict[str, Any]]:
    return [{"name": "p", "model": MODEL, "engine": "vllm", "endpoints": [{"url": u} for u in urls]}]


def batch_section(**runner: Any) -> dict[str, Any]:
    return {"max_file_bytes": 256 * 1024, "runner": {"tick_s": 0.05, "retry_min_s": 0.1, **runner}}


def chat_lines(n: int, max_tokens: int = 16, prefix: str = "r") -> bytes:
    rows = [
        {
            "custom_id": f"{prefix}{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": max_tokens},
        }
        for i in range(n)
    ]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def client(gw: Gateway, key: str = TEST_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=30)


def wait_batch(
    gw_of: Callable[[], Gateway],
    batch_id: str,
    until: Callable[[Any], bool],
    timeout_s: float = 120,
    key: str = TEST_KEY,
) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = client(gw_of(), key).batches.retrieve(batch_id)
        except openai.APIConnectionError:
            last = None
        if last is not None and until(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never got there: {last}")


def counts(batch: Any) -> Any:
    assert batch.request_counts is not None
    return batch.request_counts


def rows(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines()]


def ledger(gw: Gateway) -> list[dict[str, Any]]:
    found = []
    for path in sorted((gw.workdir / "var" / "usage").glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


@pytest.fixture(scope="module")
def fast_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngines]:
    sim = start_sim(tmp_path_factory.mktemp("batch-fast"), served_model_name=MODEL, time_scale=20.0)
    with running(sim):
        yield sim


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEngines]:
    """Real-time engines: a line of 96 tokens takes most of a second, so a batch is caught mid-way."""
    sim = start_sim(tmp_path_factory.mktemp("batch-slow"), count=2, served_model_name=MODEL, time_scale=1.0)
    with running(sim):
        yield sim


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, fast_engine: SimEngines) -> Iterator[Gateway]:
    gw = start_gateway(
        tmp_path_factory.mktemp("batch-gw"),
        pools=pools(fast_engine.urls),
        policies=policies(),
        batch=batch_section(),
        ledger={"commit_interval_ms": 10},
    )
    with running(gw):
        yield gw


def test_files_round_trip_and_another_keys_ids_are_404(gateway: Gateway) -> None:
    c, other = client(gateway), client(gateway, OTHER_KEY)
    content = chat_lines(3)
    created = c.files.create(file=("in.jsonl", content), purpose="batch")
    assert created.purpose == "batch" and created.bytes == len(content) and created.filename == "in.jsonl"
    assert created.status == "processed" and created.expires_at is not None
    assert c.files.retrieve(created.id).id == created.id
    assert c.files.content(created.id).content == content
    assert created.id in [f.id for f in c.files.list()]
    assert created.id not in [f.id for f in other.files.list()]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=created.id, endpoint="/v1/chat/completions", completion_window="24h")
    deleted = c.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(created.id)


def test_broken_lines_are_refused_line_by_line(gateway: Gateway) -> None:
    good = chat_lines(1).decode().strip()
    broken = "\n".join(
        [
            good,
            '{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}',
            good,  # the same custom_id again
            "not json",
            json.dumps({"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL}}),
        ]
    )
    with pytest.raises(openai.BadRequestError) as raised:
        client(gateway).files.create(file=("bad.jsonl", broken.encode()), purpose="batch")
    error = raised.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_batch_file" and error["param"] == "file"
    assert [(e["line"], e["code"]) for e in error["errors"]] == [
        (2, "invalid_method"),
        (3, "duplicate_custom_id"),
        (4, "invalid_json"),
        (5, "invalid_body"),
    ]
    assert error["errors"][3]["param"] == "body.messages"
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client(gateway).files.create(file=("in.jsonl", chat_lines(1)), purpose="fine-tune")
    assert wrong_purpose.value.body["param"] == "purpose"  # type: ignore[index]


def test_an_oversized_file_is_refused(gateway: Gateway) -> None:
    big = chat_lines(3000)
    assert len(big) > 256 * 1024
    with pytest.raises(openai.APIStatusError) as raised:
        client(gateway).files.create(file=("big.jsonl", big), purpose="batch")
    assert raised.value.status_code == 413
    assert raised.value.body["code"] == "file_too_large"  # type: ignore[index]


def _raw(gw: Gateway, head: bytes, body: bytes) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 exchange over a plain socket (bytes no client library would send): the status,
    headers and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(head + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or b"\r\n\r\n"
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            more = sock.recv(65536)
            if not more:
                break
            rest += more
    return int(lines[0].split()[1]), headers, json.loads(rest[:length]) if length else None


def _form(name: bytes, value: bytes, boundary: bytes = b"XbatchX") -> bytes:
    return (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + boundary + b"\r\nContent-Disposition: form-data; " + name + b'; filename="in.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + value + b"\r\n--" + boundary + b"--\r\n"
    )


def _upload_head(gw: Gateway, length: int, key: str = TEST_KEY, boundary: bytes = b"XbatchX") -> bytes:
    return (
        b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: multipart/form-data; boundary=%s\r\nContent-Length: %d\r\nConnection: close\r\n"
        % (gw.port, key.encode(), boundary, length)
    )


@pytest.mark.parametrize(
    "name",
    [
        b'name="a\rb"',
        b'name="a\nb"',
        b'name="a\r\nb"',
        b'name="a\x00b"',
        b'name="a"b"',
        b'name="',
        b"name*=UTF-8''a%0D%0Ab",
        b"name=\"file\"; filename*=UTF-8''in%0A.jsonl",
    ],
    ids=["CR", "LF", "CRLF", "NUL", "stray quote", "unclosed quote", "encoded CRLF", "encoded LF in filename"],
)
def test_a_malformed_form_part_is_a_400_in_openais_shape(gateway: Gateway, name: bytes) -> None:
    body = _form(name, chat_lines(1, prefix="mp"))
    status, headers, error = _raw(gateway, _upload_head(gateway, len(body)), body)
    assert status == 400, (status, error)
    assert headers["content-type"].startswith("application/json")
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    assert "unhandled error" not in gateway.log() and "Error handling request" not in gateway.log()


def test_a_form_without_its_boundary_is_a_400(gateway: Gateway) -> None:
    body = _form(b'name="file"', chat_lines(1), boundary=b"other")
    status, _, error = _raw(gateway, _upload_head(gateway, len(body)), body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error", (status, error)
    head = _upload_head(gateway, len(body)).replace(b"; boundary=XbatchX", b"")
    status, _, error = _raw(gateway, head, body)
    assert status == 400 and "boundary" in error["error"]["message"], (status, error)


def test_files_and_batches_are_requests_under_the_keys_rate_limit(gateway: Gateway) -> None:
    """rpm 2: each call is one request (two fit), whatever it is, and a third is a 429 in OpenAI's
    shape, before an upload's body is read."""
    c = client(gateway, RATED_KEY)
    made = c.files.with_raw_response.create(file=("in.jsonl", chat_lines(1, prefix="rl")), purpose="batch")
    assert made.headers["x-ratelimit-limit-requests"] == "2"
    file = made.parse()
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.input_file_id == file.id  # two calls, each charged once, both fit in rpm 2
    for call in (c.files.list, lambda: c.batches.retrieve(batch.id), lambda: c.files.content(file.id)):
        with pytest.raises(openai.RateLimitError) as refused:
            call()
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert "retry-after" in refused.value.response.headers
    # an upload announced and never sent is refused at once (a 408 would mean it was waited for)
    status, headers, error = _raw(gateway, _upload_head(gateway, 200_000, RATED_KEY), b"--XbatchX\r\n")
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded" and "retry-after" in headers


def test_batch_validation_cancel_and_pagination(gateway: Gateway) -> None:
    c = client(gateway)
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h")
    bad_endpoints: list[object] = [[], {"a": 1}, 7]
    for endpoint in bad_endpoints:  # not a string: a 400 naming the field, never a 500 (unhashable)
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            c.batches.create(input_file_id="file-x", endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    file = c.files.create(file=("in.jsonl", chat_lines(2)), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="48h")  # type: ignore[arg-type]
    mismatched = c.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = wait_batch(lambda: gateway, mismatched.id, lambda b: b.status in FINISHED)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors.data[0].code == "invalid_url" and failed.errors.data[0].line == 1

    ids = [
        c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == [ids[2], ids[1]] and first.has_more
    second = c.batches.list(limit=2, after=ids[1])
    assert [b.id for b in second.data][:1] == [ids[0]]
    assert {b.id for b in c.batches.list()} >= set(ids)
    other = client(gateway, OTHER_KEY)
    assert not {b.id for b in other.batches.list()} & set(ids)
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(ids[0])
    for batch_id in ids:
        wait_batch(lambda: gateway, batch_id, lambda b: b.status in FINISHED)
    with pytest.raises(openai.BadRequestError):
        c.batches.cancel(ids[0])  # completed: too late


def test_cancel_stops_a_running_batch(slow_engine: SimEngines, tmp_path: Path) -> None:
    gw = start_gateway(
        tmp_path / "gw",
        pools=pools(slow_engine.urls),
        policies=policies(),
        batch=batch_section(max_lines_per_endpoint=2),
    )
    with running(gw):
        c = client(gw)
        file = c.files.create(file=("in.jsonl", chat_lines(40, max_tokens=96)), purpose="batch")
        batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_batch(lambda: gw, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed >= 2)
        cancelling = c.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        done = wait_batch(lambda: gw, batch.id, lambda b: b.status in FINISHED)
        assert done.status == "cancelled" and done.cancelled_at is not None
        served = rows(c, done.output_file_id)
        unrun = rows(c, done.error_file_id)
        assert len(served) == done.request_counts.completed >= 2
        assert {r["error"]["code"] for r in unrun} == {"batch_cancelled"}
        assert len(served) + len(unrun) == 40


def test_a_batch_survives_a_kill_9_and_a_graceful_restart(slow_engine: SimEngines, tmp_path: Path) -> None:
    workdir = tmp_path / "gw"
    config: dict[str, Any] = {
        "pools": pools(slow_engine.urls),
        "policies": policies(),
        "batch": batch_section(max_lines_per_endpoint=2),
        "ledger": {"commit_interval_ms": 10},
    }
    current = [start_gateway(workdir, **config)]
    try:
        c = client(current[0])
        file = c.files.create(file=("in.jsonl", chat_lines(36, max_tokens=96)), purpose="batch")
        batch = c.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "restart"}
        )
        assert batch.status == "validating" and counts(batch).total == 36
        for how, at_least in ((signal.SIGKILL, 6), (signal.SIGTERM, 14)):

            def far_enough(b: Any, n: int = at_least) -> bool:
                return bool(counts(b).completed >= n)

            mid = wait_batch(lambda: current[0], batch.id, far_enough)
            assert mid.status == "in_progress" and counts(mid).completed < 36, mid
            current[0].stop(how)
            current[0] = start_gateway(workdir, **config)  # same directory: var/batch holds the progress
            again = client(current[0]).batches.retrieve(batch.id)
            assert counts(again).completed >= counts(mid).completed  # nothing recorded is lost
        done = wait_batch(lambda: current[0], batch.id, lambda b: b.status in FINISHED)
        assert done.status == "completed" and done.error_file_id is None
        assert done.request_counts.completed == 36 and done.request_counts.failed == 0
        assert done.metadata == {"run": "restart"}
        c = client(current[0])
        output = rows(c, done.output_file_id)
        assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(36)]  # every line once, in order
        assert all(
            r["response"]["status_code"] == 200 and r["response"]["body"]["object"] == "chat.completion" for r in output
        )
        assert done.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in output)
        records = [r for r in ledger(current[0]) if r.get("batch_id") == batch.id and r["status"] == "ok"]
        assert {r["request_id"] for r in records} >= {r["response"]["request_id"] for r in output}
    finally:
        current[0].stop()


def test_batch_price_and_tenant_limits(gateway: Gateway) -> None:
    c = client(gateway, LIMITED_KEY)  # one request at a time: the batch's lines queue behind each other
    file = c.files.create(file=("in.jsonl", chat_lines(6, prefix="p")), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(lambda: gateway, batch.id, lambda b: b.status in FINISHED, key=LIMITED_KEY)
    assert done.status == "completed" and done.request_counts.completed == 6 and done.request_counts.failed == 0
    live = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "now"}], max_tokens=8
    )
    live_id = live.headers["x-request-id"]
    deadline = time.monotonic() + 10
    served: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not any(r["request_id"] == live_id for r in ledger(gateway)):
        time.sleep(0.1)
    records = [r for r in ledger(gateway) if r.get("batch_id") == batch.id]
    served = [r for r in records if r["status"] == "ok"]
    assert len(served) == 6
    assert any(r["http_status"] == 429 for r in records)  # admitted like any request: some waited their turn
    for record in served:  # half the price (batch.price_factor: 0.5)
        full = record["input_tokens"] * 1e-6 + record["output_tokens"] * 2e-6
        assert record["cost_usd"] == pytest.approx(0.5 * full)
    live_record = next(r for r in ledger(gateway) if r["request_id"] == live_id)
    assert "batch_id" not in live_record
    assert live_record["cost_usd"] == pytest.approx(
        live_record["input_tokens"] * 1e-6 + live_record["output_tokens"] * 2e-6
    )


def test_responses_and_embeddings_batches(gateway: Gateway) -> None:
    c = client(gateway)
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": "hi", "max_output_tokens": 8},
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": "yo", "store": False},
        },
    ]
    file = c.files.create(file=("r.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_batch(lambda: gateway, batch.id, lambda b: b.status in FINISHED)
    output = rows(c, done.output_file_id)
    assert [r["custom_id"] for r in output] == ["a", "b"]
    assert all(r["response"]["body"]["object"] == "response" for r in output)
    stored = output[0]["response"]["body"]["id"]
    assert c.responses.retrieve(stored).id == stored  # store: true keeps it, as for a live request


def test_two_replicas_share_a_batch_in_redis(
    slow_engine: SimEngines, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix}
    config: dict[str, Any] = {
        "pools": pools(slow_engine.urls),
        "policies": policies(),
        "state": state,
        "batch": batch_section(max_lines_per_endpoint=2, lease_s=2.0),
        "ledger": {"commit_interval_ms": 10},
    }
    a = start_gateway(tmp_path / "a", **config)
    b = start_gateway(tmp_path / "b", **config)
    with running(a, b):
        c = client(a)
        file = c.files.create(file=("in.jsonl", chat_lines(30, max_tokens=96)), purpose="batch")
        assert client(b).files.retrieve(file.id).id == file.id  # the file lives in Redis: every replica has it
        with pytest.raises(openai.NotFoundError):
            client(b, OTHER_KEY).files.retrieve(file.id)
        batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_batch(lambda: b, batch.id, lambda x: x.request_counts.completed >= 6)
        a.stop(signal.SIGKILL)  # its claimed lines are taken over once their leases run out
        done = wait_batch(lambda: b, batch.id, lambda x: x.status in FINISHED)
        assert done.status == "completed" and done.request_counts.completed == 30
        output = rows(client(b), done.output_file_id)
        assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(30)]
        ran_a = {r["request_id"] for r in ledger(a) if r.get("batch_id") == batch.id}
        ran_b = {r["request_id"] for r in ledger(b) if r.get("batch_id") == batch.id}
        assert ran_a and ran_b  # both replicas ran lines
