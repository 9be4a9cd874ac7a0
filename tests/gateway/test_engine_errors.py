"""Engine 4xx bodies become OpenAI's error shape: types from the status, string codes, bounded fields;
engine 5xx are told apart: the endpoint's (overload, silence) from the request's (an error body)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.upstream.engine_errors import MAX_MESSAGE_CHARS, engine_fault, openai_error, request_status


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        pytest.param(
            400,
            {"error": {"message": "Token id 9 is out of vocabulary", "type": "BadRequestError", "param": "input",
                       "code": 400}},
            {"message": "Token id 9 is out of vocabulary", "type": "invalid_request_error", "param": "input",
             "code": None},
            id="vllm-nested",
        ),
        pytest.param(
            400,
            {"object": "error", "message": "This model's maximum context length is 8192 tokens.",
             "type": "BadRequestError", "param": None, "code": 400},
            {"message": "This model's maximum context length is 8192 tokens.", "type": "invalid_request_error",
             "param": None, "code": "context_length_exceeded"},
            id="vllm-top-level-context",
        ),
        pytest.param(
            404,
            {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model",
                       "code": 404}},
            {"message": "The model `x` does not exist.", "type": "invalid_request_error", "param": "model",
             "code": "model_not_found"},
            id="vllm-404",
        ),
        pytest.param(
            403,
            {"error": {"message": "no", "type": "permission_error", "param": None, "code": "model_not_allowed"}},
            {"message": "no", "type": "permission_error", "param": None, "code": "model_not_allowed"},
            id="already-openai",
        ),
        pytest.param(
            401, {"error": "Unauthorized"},
            {"message": "Unauthorized", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"},
            id="vllm-bare-401",
        ),
    ],
)  # fmt: skip
def test_engine_errors_in_openai_shape(status: int, raw: dict[str, Any], expected: dict[str, Any]) -> None:
    assert openai_error(status, orjson.dumps(raw)) == {"error": expected}


def test_text_and_huge_bodies_are_bounded() -> None:
    plain = openai_error(422, b"unprocessable")["error"]
    assert plain == {"message": "unprocessable", "type": "invalid_request_error", "param": None, "code": None}
    huge = openai_error(400, orjson.dumps({"error": {"message": "x" * 10**6, "param": "p" * 10**6, "code": "y" * 99}}))
    assert len(huge["error"]["message"]) == MAX_MESSAGE_CHARS
    assert len(huge["error"]["param"]) <= 128 and huge["error"]["code"] is None
    assert openai_error(400, b"")["error"]["message"] == "the engine answered 400"


@pytest.mark.parametrize(
    ("status", "raw", "fault"),
    [
        pytest.param(503, b'{"error": {"message": "overloaded"}}', "endpoint", id="503-overload"),
        pytest.param(502, b"bad gateway", "endpoint", id="502-proxy"),
        pytest.param(504, b"", "endpoint", id="504-timeout"),
        pytest.param(500, b"", "endpoint", id="500-without-body"),
        pytest.param(500, b"  \n", "endpoint", id="500-blank-body"),
        pytest.param(
            500,
            b'{"error": {"message": "EngineCore died", "type": "InternalServerError", "param": null, "code": 500}}',
            "crash",
            id="vllm-500",
        ),
        pytest.param(500, b"engine crashed on this input", "crash", id="plain-text-500"),
        pytest.param(
            500,
            b'{"error": {"message": "bad schema", "type": "BadRequestError", "param": "response_format", "code": 400}}',
            "request",
            id="500-naming-a-bad-request",
        ),
        pytest.param(500, b'{"object": "error", "message": "x", "type": "ValidationError"}', "request", id="top-level"),
        pytest.param(500, b'{"error": {"message": "x", "code": true}}', "crash", id="bool-code-is-no-status"),
    ],
)
def test_engine_5xx_are_told_apart(status: int, raw: bytes, fault: str) -> None:
    """Overload and silence are the endpoint's (retried, fallbacks); an error body is the request's."""
    assert engine_fault(status, raw) == fault


def test_a_request_fault_is_answered_with_the_bodys_own_4xx() -> None:
    assert request_status(b'{"error": {"message": "x", "type": "NotFoundError", "code": 404}}') == 404
    assert request_status(b'{"error": {"message": "x", "type": "BadRequestError"}}') == 400
    assert request_status(b'{"error": {"message": "x", "code": 503}}') == 400
