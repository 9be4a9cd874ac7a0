"""The Gemini stand-in checked by google-genai (`genai.Client` with a base URL): its shapes are the SDK's shapes.

The stand-in runs as a process (`python -m sim.hosted gemini`, tests/sim/hosted/standin.py):
google-genai's client used here is synchronous.
"""

from __future__ import annotations

from collections.abc import Iterator

import pydantic
import pytest
from google import genai
from google.genai import errors, types

from tests.sim.hosted.standin import StandIn, standin

pytestmark = pytest.mark.e2e

MODEL = "gemini-2.5-flash"
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # over the 1024-token cache minimum


@pytest.fixture(scope="module")
def gemini_standin() -> Iterator[StandIn]:
    with standin("gemini") as running:
        yield running


def client(url: str, api_key: str = "test-key") -> genai.Client:
    options = types.HttpOptions(base_url=url, retry_options=types.HttpRetryOptions(attempts=1))
    return genai.Client(api_key=api_key, http_options=options)


def get_weather(city: str) -> str:
    """Weather in a city."""
    return "sunny"


def test_generate_content_and_its_stream_say_the_same(gemini_standin: StandIn) -> None:
    gemini = client(gemini_standin.url)
    config = types.GenerateContentConfig(system_instruction="Be brief.", max_output_tokens=40)
    answer = gemini.models.generate_content(model=MODEL, contents="Hello there", config=config)
    assert (
        answer.text
        and answer.candidates
        and answer.candidates[0].finish_reason
        in (
            types.FinishReason.STOP,
            types.FinishReason.MAX_TOKENS,
        )
    )
    assert answer.usage_metadata and answer.usage_metadata.candidates_token_count
    chunks = list(gemini.models.generate_content_stream(model=MODEL, contents="Hello there", config=config))
    assert "".join(c.text or "" for c in chunks) == answer.text
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == answer.candidates[0].finish_reason
    assert last.usage_metadata == answer.usage_metadata


def test_function_calls_and_responses(gemini_standin: StandIn) -> None:
    gemini = client(gemini_standin.url)
    config = types.GenerateContentConfig(
        tools=[get_weather],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        thinking_config=types.ThinkingConfig(thinking_budget=512, include_thoughts=True),
    )
    first = gemini.models.generate_content(model=MODEL, contents="Weather in Paris?", config=config)
    assert first.function_calls and first.function_calls[0].name == "get_weather"
    assert set(first.function_calls[0].args or {}) == {"city"}
    assert first.usage_metadata and first.usage_metadata.thoughts_token_count
    assert first.candidates and any(p.thought for p in first.candidates[0].content.parts or [])  # type: ignore[union-attr]
    history = [
        types.Content(role="user", parts=[types.Part(text="Weather in Paris?")]),
        first.candidates[0].content,
        types.Content(
            role="user", parts=[types.Part.from_function_response(name="get_weather", response={"output": "sunny"})]
        ),
    ]
    second = gemini.models.generate_content(model=MODEL, contents=history, config=config)  # type: ignore[arg-type]
    assert second.text and not second.function_calls
    streamed = list(gemini.models.generate_content_stream(model=MODEL, contents="Weather?", config=config))
    assert any(c.function_calls for c in streamed)
    automatic = gemini.models.generate_content(
        model=MODEL, contents="Weather in Rome?", config=types.GenerateContentConfig(tools=[get_weather])
    )
    assert automatic.text  # the SDK called get_weather itself and sent its answer back


def test_implicit_and_explicit_caches_are_read(gemini_standin: StandIn) -> None:
    gemini = client(gemini_standin.url)
    config = types.GenerateContentConfig(system_instruction=LONG)
    first = gemini.models.generate_content(model=MODEL, contents="Summarise.", config=config).usage_metadata
    second = gemini.models.generate_content(model=MODEL, contents="Summarise.", config=config).usage_metadata
    assert first and second and not first.cached_content_token_count
    assert second.cached_content_token_count and second.prompt_token_count == first.prompt_token_count

    cache = gemini.caches.create(
        model=MODEL, config=types.CreateCachedContentConfig(contents=LONG, ttl="300s", display_name="doc")
    )
    assert cache.name and cache.name.startswith("cachedContents/")
    assert cache.usage_metadata and cache.usage_metadata.total_token_count
    used = gemini.models.generate_content(
        model=MODEL, contents="Summarise.", config=types.GenerateContentConfig(cached_content=cache.name)
    ).usage_metadata
    assert used and used.cached_content_token_count == cache.usage_metadata.total_token_count
    assert gemini.caches.get(name=cache.name).name == cache.name
    gemini.caches.delete(name=cache.name)
    with pytest.raises(errors.ClientError):
        gemini.caches.get(name=cache.name)


def test_structured_output(gemini_standin: StandIn) -> None:
    class Person(pydantic.BaseModel):
        name: str
        age: int

    config = types.GenerateContentConfig(response_mime_type="application/json", response_schema=Person)
    gemini = client(gemini_standin.url)  # held: a client dropped mid-call closes its connection pool
    answer = gemini.models.generate_content(model=MODEL, contents="Who?", config=config)
    assert isinstance(answer.parsed, Person)


def test_bad_keys_and_invalid_requests_are_refused(gemini_standin: StandIn) -> None:
    stranger = client(gemini_standin.url, api_key="wrong")
    with pytest.raises(errors.ClientError) as refused:
        stranger.models.generate_content(model=MODEL, contents="hi")
    assert refused.value.code == 400 and refused.value.status == "INVALID_ARGUMENT"
    assert "API key not valid" in (refused.value.message or "")
    gemini = client(gemini_standin.url)
    with pytest.raises(errors.ClientError) as refused:
        gemini.models.generate_content(
            model=MODEL, contents="hi", config=types.GenerateContentConfig(candidate_count=9)
        )
    assert refused.value.status == "INVALID_ARGUMENT"


def test_over_the_rate_limit_is_resource_exhausted() -> None:
    with standin("gemini", "--rpm", "1") as running:
        gemini = client(running.url)
        gemini.models.generate_content(model=MODEL, contents="hi")
        with pytest.raises(errors.ClientError) as refused:
            gemini.models.generate_content(model=MODEL, contents="hi")
        assert refused.value.code == 429 and refused.value.status == "RESOURCE_EXHAUSTED"
        assert running.usage()["total"]["refused"] == 1  # type: ignore[index]


def test_a_stream_breaks_off_with_an_error_event() -> None:
    with standin("gemini", "--fail-after-tokens", "3") as running:
        gemini = client(running.url)
        seen = []
        with pytest.raises(errors.APIError) as broken:
            for chunk in gemini.models.generate_content_stream(model=MODEL, contents="hi"):
                seen.append(chunk)  # noqa: PERF402 (what arrived before the error)
        assert broken.value.status == "INTERNAL"
        assert len(seen) == 3


def test_queued_faults_are_geminis_own_errors(gemini_standin: StandIn) -> None:
    gemini = client(gemini_standin.url)
    gemini_standin.fault(503)
    with pytest.raises(errors.ServerError) as failed:
        gemini.models.generate_content(model=MODEL, contents="hi")
    assert failed.value.code == 503 and failed.value.status == "UNAVAILABLE"
    assert gemini.models.generate_content(model=MODEL, contents="hi").text  # the queue is spent


def test_gemini_3_wants_its_thought_signature_back(gemini_standin: StandIn) -> None:
    gemini = client(gemini_standin.url)
    model = "gemini-3-pro-preview"
    config = types.GenerateContentConfig(
        tools=[get_weather], automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True)
    )
    first = gemini.models.generate_content(model=model, contents="Weather in Paris?", config=config)
    assert first.candidates and first.candidates[0].content and first.candidates[0].content.parts
    call_part = next(p for p in first.candidates[0].content.parts if p.function_call)
    assert call_part.thought_signature
    answer = types.Part.from_function_response(name="get_weather", response={"output": "sunny"})
    history = [
        types.Content(role="user", parts=[types.Part(text="Weather in Paris?")]),
        first.candidates[0].content,
        types.Content(role="user", parts=[answer]),
    ]
    assert gemini.models.generate_content(model=model, contents=history, config=config).text
    unsigned = types.Content(role="model", parts=[types.Part(function_call=call_part.function_call)])
    with pytest.raises(errors.ClientError) as refused:
        gemini.models.generate_content(model=model, contents=[history[0], unsigned, history[2]], config=config)
    assert refused.value.code == 400 and "thought_signature" in (refused.value.message or "")
