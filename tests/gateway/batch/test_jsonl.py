"""A batch input file checked line by line: per-line errors with line numbers, spans of the requests."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.batch.routes import check_line, scan_file


def line(custom_id: str = "a", url: str = "/v1/chat/completions", **body: object) -> bytes:
    request = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request})


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        pytest.param(b"{not json", "invalid_json", None, id="not-json"),
        pytest.param(b"[1, 2]", "invalid_request", None, id="not-object"),
        pytest.param(b'{"method": "POST"}', "missing_custom_id", "custom_id", id="no-custom-id"),
        pytest.param(
            orjson.dumps({"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
            "invalid_method",
            "method",
            id="get",
        ),
        pytest.param(line(url="/v1/images/generations"), "invalid_url", "url", id="unsupported-url"),
        pytest.param(line(model="m"), "invalid_body", "body.messages", id="chat-without-messages"),
        pytest.param(
            line(model="m", messages=[{"role": "user", "content": "x"}], stream=True),
            "invalid_body",
            "body.stream",
            id="stream",
        ),
        pytest.param(line(url="/v1/embeddings", model="m", input=""), "invalid_body", "body.input", id="empty-input"),
        pytest.param(line(url="/v1/responses", model="m"), "invalid_body", "body.input", id="responses-no-input"),
    ],
)
def test_bad_line(raw: bytes, code: str, param: str | None) -> None:
    parsed, problem = check_line(raw)
    assert parsed is None and problem is not None
    assert problem[0] == code
    assert problem[2] == param


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(line(), id="chat"),
        pytest.param(line(url="/v1/completions", model="m", prompt="hi"), id="completions"),
        pytest.param(line(url="/v1/embeddings", model="m", input=["a", "b"]), id="embeddings"),
        pytest.param(line(url="/v1/responses", model="m", input="hi", instructions="brief"), id="responses"),
    ],
)
def test_good_line(raw: bytes) -> None:
    parsed, problem = check_line(raw)
    assert problem is None and parsed is not None


def test_scan_reports_every_bad_line_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b"\n".join([line("a"), b"", line("b", url="/v1/nope"), line("a"), b"oops", line("c", model="m")]) + b"\n"
    )
    scan, _spans = scan_file(path, max_lines=100)
    assert not scan.ok
    assert [(e.line, e.code) for e in scan.errors] == [
        (3, "invalid_url"),
        (4, "duplicate_custom_id"),
        (5, "invalid_json"),
        (6, "invalid_body"),
    ]
    assert "already used on line 1" in scan.errors[1].message
    assert scan.summary().startswith("4 line(s) of the batch file are invalid: line 3:")


def test_scan_spans_locate_each_request_and_note_urls_and_models(tmp_path: Path) -> None:
    lines = [line("a"), line("b", url="/v1/completions", model="other", prompt="x"), line("c")]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\r\n".join(lines) + b"\r\n\n")  # CRLF and a blank tail
    scan, spans = scan_file(path, max_lines=100)
    assert scan.ok and scan.lines == 3
    data = path.read_bytes()
    assert [data[spans[2 * i] : spans[2 * i] + spans[2 * i + 1]] for i in range(3)] == lines
    assert scan.urls == {"/v1/chat/completions": 1, "/v1/completions": 2}
    assert scan.models == {"m": 1, "other": 2}


def test_scan_counts_beyond_the_line_limit_once(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(line(str(i)) for i in range(5)))  # no trailing newline
    scan, spans = scan_file(path, max_lines=3)
    assert [e.code for e in scan.errors] == ["too_many_lines"]
    assert len(spans) == 6


def test_an_empty_file_is_not_ok(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n\n")
    scan, _ = scan_file(path, max_lines=3)
    assert not scan.ok
    assert "holds no requests" in scan.summary()


@pytest.mark.parametrize("depth", [80, 300])
def test_a_line_nested_too_deep_is_refused_naming_the_field(depth: int) -> None:
    deep = b'{"k":' * depth + b'"x"' + b"}" * depth  # written out: orjson encodes 254 levels at most
    raw = line(model="m", messages=[{"role": "user", "content": "hi"}], metadata="DEEP").replace(b'"DEEP"', deep)
    parsed, problem = check_line(raw)
    assert parsed is None and problem is not None
    code, message, param = problem
    assert code == "too_deep" and param is not None and param.startswith("body.metadata.k.k")
    assert "nested more than" in message


def test_a_line_as_deep_as_a_live_request_may_be_is_accepted() -> None:
    deep: object = "x"
    for _ in range(40):
        deep = [deep]
    _parsed, problem = check_line(line(model="m", messages=[{"role": "user", "content": "hi"}], stop=deep))
    assert problem is None or problem[0] != "too_deep"
