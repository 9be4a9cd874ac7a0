"""Fixtures for the simulated engine: in-process instances on real sockets, and small helpers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.server import SimInstance, run_sim_engines


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[SimInstance]:
    """One llama-3.1-8b@h100 instance at time scale 20; override options with
    ``@pytest.mark.parametrize("engine", [{...}], indirect=True)``."""
    options: dict[str, Any] = {"time_scale": 20.0, **getattr(request, "param", {})}
    async with run_sim_engines(options.pop("preset", "llama-3.1-8b@h100"), 1, **options) as instances:
        yield instances[0]


def chat_body(text: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client, keyed by (name, sorted labels)."""
    async with http.get(base_url + "/metrics") as resp:
        text = await resp.text()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and all(dict(sample_labels).get(k) == v for k, v in labels.items())
    )
