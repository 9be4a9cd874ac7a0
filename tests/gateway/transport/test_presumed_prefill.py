"""A non-streamed request's prompt stops counting as a pending prefill on its endpoint at its predicted
TTFT (it shows no first token until its whole answer), so flow control's clear lane and the routers'
prefill load do not hold it pending for the whole request."""

from __future__ import annotations

import asyncio

import numpy as np

from backends.types import Endpoint, EndpointState
from gateway.transport.engine import presume_prefilled
from policies.routing.types import RouteDecision
from predictor.features import Prediction


def endpoint() -> Endpoint:
    return Endpoint(id="p/a", pool="p", base_url="http://x", engine="sim", served_model="m", state=EndpointState.READY)


def decision(e: Endpoint, ttft_ms: float | None) -> RouteDecision:
    made = None
    if ttft_ms is not None:
        made = {e.id: Prediction(e.id, ttft_ms, 10.0, ttft_ms, 10.0, "prior", "prior", np.zeros(1, dtype=np.float32))}
    return RouteDecision(e, "load", predictions=made)


async def test_the_prompt_counts_as_prefilled_once_its_predicted_ttft_has_passed() -> None:
    e = endpoint()
    load = e.inflight.begin(300)
    presumed = presume_prefilled(load, decision(e, 0.0), 420)
    assert presumed is not None and e.inflight.prefill_tokens == 300
    await asyncio.sleep(0.01)
    assert (e.inflight.prefill_tokens, e.inflight.decode_tokens, e.inflight.requests) == (0, 420, 1)
    load.first_token(500)  # the answer arrives: nothing counted twice
    load.end()
    assert (e.inflight.prefill_tokens, e.inflight.decode_tokens, e.inflight.requests) == (0, 0, 0)


async def test_without_a_prediction_or_after_the_end_the_answer_releases_it() -> None:
    e = endpoint()
    load = e.inflight.begin(300)
    assert presume_prefilled(load, decision(e, None), 420) is None
    assert e.inflight.prefill_tokens == 300
    presumed = presume_prefilled(load, decision(e, 0.0), 420)
    assert presumed is not None
    presumed.cancel()  # the attempt ended first
    load.end()
    await asyncio.sleep(0.01)
    assert (e.inflight.prefill_tokens, e.inflight.decode_tokens, e.inflight.requests) == (0, 0, 0)
