"""Program identity (gateway/request/intake.py): each source, their order, the bounds, and the ledger."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.ledger.writer import decode, encode
from gateway.request.intake import MAX_PROGRAM_CHARS, program_id
from gateway.request.record import RequestRecord

ALL_BODY: dict[str, Any] = {
    "metadata": {"user_id": "meta-user"},
    "prompt_cache_key": "cache-key",
    "user": "end-user",
}
ALL_HEADERS = {
    "x-tokenway-program": "explicit",
    "x-session-id": "session",
    "x-claude-code-session-id": "claude-code",
    "x-session-affinity": "affinity",
}


def test_none_when_nothing_names_a_program() -> None:
    assert program_id({}, {"model": "m", "messages": []}) is None
    assert program_id({"x-session-id": ""}, {"user": "", "metadata": {"user_id": ""}}) is None


@pytest.mark.parametrize(
    ("drop_headers", "drop_body", "expected"),
    [
        ((), (), "explicit"),
        (("x-tokenway-program",), (), "session"),
        (("x-tokenway-program", "x-session-id"), (), "claude-code"),
        (("x-tokenway-program", "x-session-id", "x-claude-code-session-id"), (), "affinity"),
        (tuple(ALL_HEADERS), (), "meta-user"),
        (tuple(ALL_HEADERS), ("metadata",), "cache-key"),
        (tuple(ALL_HEADERS), ("metadata", "prompt_cache_key"), "end-user"),
    ],
)
def test_first_source_present_wins(drop_headers: tuple[str, ...], drop_body: tuple[str, ...], expected: str) -> None:
    headers = {k: v for k, v in ALL_HEADERS.items() if k not in drop_headers}
    body = {k: v for k, v in ALL_BODY.items() if k not in drop_body}
    assert program_id(headers, body) == expected


def test_headers_are_read_case_insensitively_as_aiohttp_gives_them() -> None:
    assert program_id(CIMultiDict({"X-Tokenway-Program": "run-7"}), {}) == "run-7"


def test_body_values_of_the_wrong_type_are_skipped() -> None:
    assert program_id({}, {"metadata": "not-an-object", "prompt_cache_key": 3, "user": "u"}) == "u"
    assert program_id({}, {"metadata": {"user_id": 5}, "user": ["x"]}) is None


def test_long_ids_are_hashed_stably_and_bounded() -> None:
    long = "user_" + "a" * 64 + "_account__session_0f1e2d3c"
    first = program_id({}, {"metadata": {"user_id": long}})
    assert first is not None and first.startswith("#") and len(first) == 33
    assert program_id({"x-tokenway-program": long}, {}) == first  # the same program whatever carried it
    assert program_id({}, {"metadata": {"user_id": long + "x"}}) != first
    assert program_id({}, {"user": "b" * MAX_PROGRAM_CHARS}) == "b" * MAX_PROGRAM_CHARS  # at the cap: as sent


def test_undecodable_header_bytes_are_hashed_not_kept() -> None:
    smuggled = "run-\udcff"  # aiohttp's lone surrogate for a byte that is not UTF-8
    program = program_id({"x-tokenway-program": smuggled}, {})
    assert program is not None and program.startswith("#")
    program.encode("utf-8")  # safe to write anywhere


def test_ledger_line_carries_the_program_only_when_named() -> None:
    record = RequestRecord(request_id="r1", api="chat", started_at_unix_s=1.0)
    assert "program" not in decode(encode(record))
    record.program = "run-7"
    assert decode(encode(record))["program"] == "run-7"
