"""One canonical form per path: what `canonical_path_middleware` refuses before any route (or aiohttp's
normaliser) sees the path, and what it lets through untouched."""

from __future__ import annotations

import pytest

from gateway.app.factory import path_problem


@pytest.mark.parametrize(
    "raw",
    [
        "/v1/files/file-1/../file-1/content",
        "/v1/files/file-1/./content",
        "/v1/files/..",
        "/v1//files",
        "//v1/files",
        "/v1/files/a%2F..%2Fb",
        "/v1/files/a%2fb",
        "/v1/files/%2e%2e/x",
        "/v1/files/a%2Eb",
        "/v1/files/a%5cb",
        "/v1/files/a\\b",
        "/v1/files/a%00",
        "/v1/models/a/%2e%2e",
        "relative/path",
    ],
)
def test_non_canonical_paths_are_named(raw: str) -> None:
    assert path_problem(raw) is not None


@pytest.mark.parametrize(
    "raw",
    [
        "/v1/files/file-0123abcd/content",
        "/v1/chat/completions",
        "/v1/responses/resp_AbC-_9",
        "/v1/files?after=a/../b&x=//",  # the query is not the path
        "/v1/models/meta-llama%2FLlama-3.1-8B",  # a model name may hold a slash, percent-encoded
        "/.well-known/x",
        "/v1/files/a%20b",
        "/",
        "/v1/files/",  # a trailing slash is a question for the routes (a 404), not a second form
    ],
)
def test_canonical_paths_pass(raw: str) -> None:
    assert path_problem(raw) is None
