"""A faster clock changes how long a test waits, not what the engine reports."""

from __future__ import annotations

import aiohttp
import pytest

from sim.server import run_sim_instances
from tests.sim.conftest import chat_body, metric, post_json, scrape


async def _workload(http: aiohttp.ClientSession, time_scale: float) -> tuple[list[dict[str, float]], float]:
    async with run_sim_instances("llama-3.1-8b@h100", time_scale=time_scale) as (url,):
        timings = []
        for i in range(3):
            data = await post_json(
                http, url + "/v1/chat/completions", chat_body(f"question {i} " + "about scaling " * 60, max_tokens=6)
            )
            timings.append(data["metrics"])
        samples = await scrape(http, url)
    return timings, metric(samples, "vllm:time_to_first_token_seconds_sum")


@pytest.mark.slow
async def test_latencies_in_simulated_seconds_do_not_depend_on_the_time_scale(http: aiohttp.ClientSession) -> None:
    slow, slow_ttft_sum = await _workload(http, 1.0)
    fast, fast_ttft_sum = await _workload(http, 10.0)
    for a, b in zip(slow, fast, strict=True):
        assert abs(a["ttft_s"] - b["ttft_s"]) < 0.002
        assert abs(a["tpot_s"] - b["tpot_s"]) < 0.001
        assert abs(a["e2e_s"] - b["e2e_s"]) < 0.003
    assert abs(slow_ttft_sum - fast_ttft_sum) < 0.005
