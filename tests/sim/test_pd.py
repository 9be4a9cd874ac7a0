"""Prefill/decode disaggregation between two instances, NixlConnector-style."""

from __future__ import annotations

import aiohttp
import pytest

from sim.config import build_engine_config
from sim.server import run_sim_engines, start_instances, stop_instance
from tests.sim.conftest import chat_body, post_json

PROMPT = "Disaggregated serving moves the KV cache between instances. " * 40
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_decode_instance_pulls_the_prefilled_kv(http: aiohttp.ClientSession) -> None:
    async with run_sim_engines(count=2, time_scale=20) as (prefill, decode):
        p_leg = await post_json(
            http,
            prefill.url + "/v1/chat/completions",
            chat_body(PROMPT, max_tokens=1, kv_transfer_params=PREFILL_PARAMS),
        )
        params = p_leg["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_engine_id"] == prefill.engine.config.engine_id
        assert params["remote_engine_id"] != decode.engine.config.engine_id
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
        assert params["remote_block_ids"] and params["remote_block_ids"][0]
        assert prefill.engine.kv.usage > 0  # blocks pinned for the decode leg

        d_leg = await post_json(
            http, decode.url + "/v1/chat/completions", chat_body(PROMPT, max_tokens=8, kv_transfer_params=params)
        )
        prompt_tokens = d_leg["usage"]["prompt_tokens"]
        assert d_leg["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
        assert d_leg["usage"]["completion_tokens"] == 8
        assert d_leg["metrics"]["kv_pull_s"] > 0
        assert prefill.engine.kv.usage == 0.0  # released once read

        # A decode leg that computed the prompt itself takes longer to its first token.
        cold = await post_json(
            http, decode.url + "/v1/chat/completions", chat_body("other words " + PROMPT, max_tokens=8)
        )
        assert d_leg["metrics"]["ttft_s"] < cold["metrics"]["ttft_s"]


async def test_decode_leg_with_unknown_or_stale_params_recomputes(http: aiohttp.ClientSession) -> None:
    async with run_sim_engines(count=2, time_scale=20) as (prefill, decode):
        stale = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "gone",
            "remote_request_id": "no-such-request",
            "remote_block_ids": [[1, 2]],
            "remote_host": "127.0.0.1",
            "remote_port": prefill.port,
        }
        data = await post_json(
            http, decode.url + "/v1/chat/completions", chat_body(PROMPT, max_tokens=4, kv_transfer_params=stale)
        )
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert data["usage"]["completion_tokens"] == 4


async def test_pinned_blocks_expire_after_the_lease(http: aiohttp.ClientSession) -> None:
    transfer = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_lease_duration": 0.5},
    }
    async with run_sim_engines(count=2, time_scale=20, kv_transfer_config=transfer) as (prefill, decode):
        p_leg = await post_json(
            http,
            prefill.url + "/v1/chat/completions",
            chat_body(PROMPT, max_tokens=1, kv_transfer_params=PREFILL_PARAMS),
        )
        import asyncio

        for _ in range(100):
            if prefill.engine.kv.usage == 0.0:
                break
            await asyncio.sleep(0.01)
        assert prefill.engine.kv.usage == 0.0
        d_leg = await post_json(
            http,
            decode.url + "/v1/chat/completions",
            chat_body(PROMPT, max_tokens=2, kv_transfer_params=p_leg["kv_transfer_params"]),
        )
        assert d_leg["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_pull_runs_at_the_bandwidth_of_the_link_between_the_two_engines(http: aiohttp.ClientSession) -> None:
    """`--topology` and `--kv-link-gbps`: the decode engine prices the pull by the class of the link to
    the prefill engine's labels (backends.types.link_class), as the gateway's pairing does."""
    links = "same_rack=100,cross_rack=1"
    configs = {
        "prefill": build_engine_config(time_scale=20, topology="node=a,rack=r1"),
        "near": build_engine_config(time_scale=20, topology="node=b,rack=r1", kv_link_bandwidth_gbps=links),
        "far": build_engine_config(time_scale=20, topology="node=c,rack=r2", kv_link_bandwidth_gbps=links),
    }
    started = {name: (await start_instances(config, 1, "127.0.0.1", 0))[0] for name, config in configs.items()}
    try:
        pulls = {}
        for name in ("near", "far"):
            p_leg = await post_json(
                http,
                started["prefill"].url + "/v1/chat/completions",
                chat_body(PROMPT, max_tokens=1, kv_transfer_params=PREFILL_PARAMS),
            )
            d_leg = await post_json(
                http,
                started[name].url + "/v1/chat/completions",
                chat_body(PROMPT, max_tokens=2, kv_transfer_params=p_leg["kv_transfer_params"]),
            )
            assert d_leg["usage"]["prompt_tokens_details"]["cached_tokens"] == d_leg["usage"]["prompt_tokens"] - 1
            pulls[name] = d_leg["metrics"]["kv_pull_s"]
        assert started["near"].engine.last_pull_link == "same_rack"
        assert started["far"].engine.last_pull_link == "cross_rack"
        assert pulls["far"] > 50 * pulls["near"]  # 1 GB/s against 100 GB/s for the same KV
    finally:
        for instance in started.values():
            await stop_instance(instance)


def test_topology_and_link_bandwidths_are_checked() -> None:
    config = build_engine_config(topology="node=a, zone=z1", kv_link_bandwidth_gbps="cross_zone=2.5")
    assert (config.topology.node, config.topology.rack, config.topology.zone) == ("a", None, "z1")
    assert config.kv_link_bandwidth == {"cross_zone": 2.5e9}
    for bad in ({"topology": "host=a"}, {"kv_link_bandwidth_gbps": "far=1"}, {"kv_link_bandwidth_gbps": "same_rack=0"}):
        with pytest.raises(ValueError):
            build_engine_config(**bad)  # type: ignore[arg-type]
