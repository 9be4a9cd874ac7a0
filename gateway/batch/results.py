"""One line's outcome, as the output and error files carry it and as the store records it.

Output and error files use OpenAI's per-line object: `{"id": "batch_req_…", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}` for a request that got an HTTP answer (2xx in
the output file, 4xx/5xx in the error file), and `{"id", "custom_id", "response": null, "error":
{"code", "message"}}` for one that never got one (expired, cancelled, the batch's key revoked).

The store records each result once, write-ahead, as `<header JSON>\\t<line JSON>\\n`: the header
holds the line's index, whether it succeeded and its usage, so progress and the batch's usage are
rebuilt from the records alone, and the output files are the records' second halves in line order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.batch.objects import new_line_result_id

Usage3 = tuple[int, int, int]  # input, cached input, output tokens


@dataclass(frozen=True, slots=True)
class LineResult:
    index: int
    ok: bool
    usage: Usage3
    line: bytes  # the output / error file line (JSON, no newline)

    def record(self) -> bytes:
        header = orjson.dumps({"i": self.index, "ok": self.ok, "u": list(self.usage)})
        return header + b"\t" + self.line + b"\n"

    @classmethod
    def parse(cls, raw: bytes) -> LineResult:
        header, _, line = raw.rstrip(b"\n").partition(b"\t")
        data = orjson.loads(header)
        u = data["u"]
        if not line:
            raise ValueError("a result record without its line")
        return cls(int(data["i"]), bool(data["ok"]), (int(u[0]), int(u[1]), int(u[2])), line)


def usage_of(body: Any) -> Usage3:
    """(input, cached, output) tokens of an answer body of any batch endpoint."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return (0, 0, 0)
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    output = usage.get("completion_tokens", usage.get("output_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return (_int(prompt), _int(cached), _int(output))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def answered(index: int, custom_id: str, status: int, request_id: str, body: bytes) -> LineResult:
    """A line that got an HTTP answer: 2xx goes to the output file, anything else to the error file."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = {"error": {"message": body[:2000].decode("utf-8", "replace"), "type": "server_error"}}
    ok = 200 <= status < 300
    line = {
        "id": new_line_result_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": parsed},
        "error": None,
    }
    return LineResult(index, ok, usage_of(parsed) if ok else (0, 0, 0), orjson.dumps(line))


def unanswered(index: int, custom_id: str, code: str, message: str) -> LineResult:
    """A line that never got an HTTP answer (error file)."""
    line = {
        "id": new_line_result_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return LineResult(index, False, (0, 0, 0), orjson.dumps(line))
