"""A batch input file, checked line by line as it is uploaded.

Each non-blank line must be one JSON object `{"custom_id", "method": "POST", "url", "body"}`:
`custom_id` a non-empty string unique in the file, `url` one of the batch endpoints, `body` a valid
request for that endpoint (the same checks the endpoint applies to a live request, its nesting bound
included; `stream` is refused: a batch line's answer is written to a file). Every bad line is reported with its line
number, a code, a message and the parameter at fault — the first `max_errors` of them in full, the
rest counted. The scan also notes which urls and models the file uses (and the first line of each),
so creating a batch can say which line does not fit it without reading the file again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from gateway.apis.responses import ResponsesCall
from gateway.batch.objects import ENDPOINTS
from gateway.errors import GatewayError
from gateway.http.bodies import MAX_JSON_DEPTH, check_depth
from gateway.http.validate import validate_body

MAX_CUSTOM_ID_CHARS: Final = 512
_READ_CHUNK: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class LineError:
    line: int  # 1-based, as an editor numbers the file
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message, "param": self.param}


def _check_responses(body: Any) -> dict[str, Any]:
    return ResponsesCall(None).parse(body)


def _validator(api: str) -> Callable[[Any], dict[str, Any]]:
    if api == "responses":
        return _check_responses

    def check(body: Any) -> dict[str, Any]:
        return validate_body(api, body)  # type: ignore[arg-type]

    return check


_VALIDATORS: Final = {url: _validator(api) for url, api in ENDPOINTS.items()}


def check_line(raw: bytes) -> tuple[dict[str, Any] | None, tuple[str, str, str | None] | None]:
    """(the parsed line, None) or (None, (code, message, param)) for one line of the file."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, ("invalid_json", f"the line is not valid JSON: {exc}", None)
    if not isinstance(line, dict):
        return None, ("invalid_request", "each line must be a JSON object", None)
    try:  # the body is bounded as a live request's is (one level more: the line around it)
        check_depth(line, MAX_JSON_DEPTH + 1)
    except GatewayError as exc:
        return None, ("too_deep", exc.message, exc.param)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, ("missing_custom_id", "'custom_id' is required and must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return None, ("invalid_custom_id", f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id")
    if line.get("method") != "POST":
        return None, ("invalid_method", f"'method' must be \"POST\", got {line.get('method')!r}", "method")
    url = line.get("url")
    validate = _VALIDATORS.get(url) if isinstance(url, str) else None
    if validate is None:
        return None, ("invalid_url", f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        return None, ("invalid_body", "'body' must be a JSON object (the request)", "body")
    try:
        validate(body)
    except GatewayError as exc:
        return None, ("invalid_body", exc.message, f"body.{exc.param}" if exc.param else "body")
    if body.get("stream"):
        return None, (
            "invalid_body",
            "'stream' is not supported in a batch: answers are written to a file",
            "body.stream",
        )
    return line, None


@dataclass(slots=True)
class FileScan:
    """The running result of checking a file, fed one physical line at a time."""

    max_lines: int
    max_errors: int = 100
    lines: int = 0  # requests (non-blank lines) seen
    physical: int = 0
    urls: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0
    _ids: dict[bytes, int] = field(default_factory=dict)  # digest of custom_id -> first line

    def feed(self, raw: bytes) -> None:
        self.physical += 1
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            if self.lines == self.max_lines + 1:
                self._error("too_many_lines", f"a batch file holds at most {self.max_lines} requests", None)
            return
        line, problem = check_line(raw)
        if problem is not None:
            self._error(*problem)
            return
        assert line is not None
        digest = hashlib.blake2b(line["custom_id"].encode(), digest_size=16).digest()
        first = self._ids.setdefault(digest, self.physical)
        if first != self.physical:
            self._error(
                "duplicate_custom_id",
                f"'custom_id' {line['custom_id'][:80]!r} is already used on line {first}",
                "custom_id",
            )
            return
        self.urls.setdefault(line["url"], self.physical)
        self.models.setdefault(str(line["body"]["model"]), self.physical)

    def _error(self, code: str, message: str, param: str | None) -> None:
        self.error_count += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(LineError(self.physical, code, message, param))

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.lines > 0

    def summary(self) -> str:
        """One message for the whole file (the per-line errors travel beside it)."""
        if self.lines == 0 and not self.error_count:
            return "The file holds no requests: a batch file is JSONL, one request per line."
        shown = "; ".join(f"line {e.line}: {e.message}" for e in self.errors[:3])
        more = f" (and {self.error_count - 3} more)" if self.error_count > 3 else ""
        return f"{self.error_count} line(s) of the batch file are invalid: {shown}{more}."


def scan_file(path: Path, max_lines: int, max_errors: int = 100) -> tuple[FileScan, array[int]]:
    """Check every line of the file at `path` (blocking: run it in a worker thread) and note where each
    request's line lies: (offset, length) pairs, request by request, for reading line N later."""
    scan = FileScan(max_lines=max_lines, max_errors=max_errors)
    spans: array[int] = array("Q")
    offset = 0  # of the first byte of `pending`
    pending = b""
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(_READ_CHUNK)
            if not chunk:
                break
            pending += chunk
            start = 0
            while (end := pending.find(b"\n", start)) >= 0:
                _feed(scan, spans, pending[start:end], offset + start)
                start = end + 1
            offset += start
            pending = pending[start:]
    if pending:
        _feed(scan, spans, pending, offset)
    return scan, spans


def _feed(scan: FileScan, spans: array[int], raw: bytes, offset: int) -> None:
    line = raw[:-1] if raw.endswith(b"\r") else raw
    before = scan.lines
    scan.feed(line)
    if scan.lines > before and scan.lines <= scan.max_lines:
        spans.append(offset)
        spans.append(len(line))
