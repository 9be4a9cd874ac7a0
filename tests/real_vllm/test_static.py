# mypy: disable-error-code="union-attr,operator"
"""A real `vllm serve` the gateway did not launch (a static endpoint), and launched engines that fail
or lose their gateway.

The static engine publishes KV events on loopback only (`tcp://[::ffff:127.0.0.1]:P`: vLLM binds only
an endpoint containing `*` or `::`) with a replay socket, and has prefix blocks cached before any
gateway exists: a gateway started afterwards knows them from the replay at once. Prompts are counted
with the engine's own `/tokenize` (no tokenizer configured for the static pool). A launched pool with a
block size the CPU build rejects crashes with its real error shown; `kill -9` of a gateway takes its
launched engine along and leaves the static one alone.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.process import group_has_live_members
from policies.policy import cache_salt, hash_key
from tests.real_vllm.conftest import (
    MODEL,
    START_TIMEOUT_S,
    VllmServer,
    admin_backends,
    backends_settings,
    launched_pool,
)
from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, free_port, http_get, start_gateway

pytestmark = pytest.mark.e2e

POLICIES = {
    "tenants": {"t1": {}},
    "keys": [{"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)}],
    "models": {MODEL: {}, "broken": {}},
}


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture(scope="module")
def warm_engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict[str, Any]]:
    """A running `vllm serve` whose prefix cache already holds a long system prompt."""
    workdir = tmp_path_factory.mktemp("static")
    publisher, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{publisher}",
        "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{replay}",
        "topic": "kv",
    }
    server = VllmServer(workdir, model_dir, ["--kv-events-config", json.dumps(events), "--block-size", "32"])
    try:
        server.wait_ready()
        prefix = words(uuid.uuid4().hex[:6], 100)
        engine = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        engine.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": "a"}],
            extra_body={"cache_salt": cache_salt("tenant:t1")},  # as the gateway salts t1's requests
        )
        yield {"server": server, "publisher": publisher, "replay": replay, "prefix": prefix, "workdir": workdir}
    finally:
        server.stop()


def static_pool(engine: dict[str, Any]) -> dict[str, Any]:
    server: VllmServer = engine["server"]
    endpoint = {
        "url": server.url,
        "kv_events_endpoint": f"tcp://127.0.0.1:{engine['publisher']}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{engine['replay']}",
    }
    return {"name": "static", "model": MODEL, "engine": "vllm", "endpoints": [endpoint],
            "kv_events": {"enabled": True, "topic": "kv"}}  # fmt: skip


@pytest.fixture(scope="module")
def gateway(warm_engine: dict[str, Any], model_dir: Path) -> Iterator[Gateway]:
    broken = launched_pool(model_dir, name="broken", model="broken", block_size=16)  # CPU: multiples of 32 only
    gw = start_gateway(
        warm_engine["workdir"] / "gw",
        pools=[static_pool(warm_engine), broken],
        policies=POLICIES,
        wait_ready=False,
        routing={"prefix_index": {"mode": "precise", "advanced": {"speculative_ttl_s": 0}}},
        backends=backends_settings(crash_loop_restarts=1),
    )
    try:
        yield gw
    finally:
        gw.stop()


def pool_status(gw: Gateway, name: str) -> dict[str, Any]:
    return next(p for p in admin_backends(gw.url)["pools"] if p["name"] == name)


def test_a_gateway_started_after_the_engine_holds_blocks_knows_them_at_once(
    gateway: Gateway, warm_engine: dict[str, Any]
) -> None:
    def subscribed() -> dict[str, Any] | None:
        (endpoint,) = pool_status(gateway, "static")["endpoints"]
        caught_up = endpoint.get("kv_events", {}).get("catch_ups") and endpoint.get("precise_index", {}).get("blocks")
        return endpoint if caught_up and endpoint["state"] == "ready" else None

    endpoint = wait_for(subscribed, timeout_s=120, what="the replay catch-up")
    assert endpoint["kv_events"]["batches"] == endpoint["kv_events"]["replayed_batches"]  # nothing live yet
    raw = openai.OpenAI(base_url=gateway.base_url, api_key=TEST_KEY, max_retries=0, timeout=300)
    reply = raw.chat.completions.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": warm_engine["prefix"]}, {"role": "user", "content": "b"}],
        extra_headers={"x-tokenway-debug": "1"},
    )
    route = dict(part.split("=", 1) for part in reply.headers["x-tokenway-route"].split("; ") if "=" in part)
    completion = reply.parse()
    engine_cached = completion.usage.prompt_tokens_details.cached_tokens
    assert engine_cached > 0 and int(route["cached"]) == engine_cached  # known before any new event
    counted, source = reply.headers["x-tokenway-prompt-tokens"].split(";source=")
    assert (int(counted), source) == (completion.usage.prompt_tokens, "engine")  # the engine's /tokenize


def test_the_approximate_index_hashes_the_ids_the_engine_caches(warm_engine: dict[str, Any], model_dir: Path) -> None:
    """With the model's tokenizer, the approximate index's blocks are the engine's: for a shared prefix
    its estimate (same block size as the engine) equals the engine's cached tokens."""
    pool = {**static_pool(warm_engine), "tokenizer": str(model_dir), "kv_events": {"enabled": False}}
    gw = start_gateway(
        warm_engine["workdir"] / "gw-approximate",
        pools=[pool],
        policies=POLICIES,
        routing={"prefix_index": {"mode": "approximate", "block_size_tokens": 32}},
    )
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=300)
        prefix = words(uuid.uuid4().hex[:6], 90)
        replies = []
        for question in ("first", "second"):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                max_tokens=2,
                messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
                extra_headers={"x-tokenway-debug": "1"},
            )
            route = dict(part.split("=", 1) for part in raw.headers["x-tokenway-route"].split("; ") if "=" in part)
            replies.append((int(route["cached"]), raw.parse().usage.prompt_tokens_details.cached_tokens))
            assert raw.headers["x-tokenway-prompt-tokens"].endswith(";source=model")
        assert replies[0] == (0, 0)
        assert replies[1][0] == replies[1][1] > 0
    finally:
        gw.stop()


def test_a_replica_the_engine_refuses_shows_the_real_error(gateway: Gateway) -> None:
    def dead() -> dict[str, Any] | None:
        (endpoint,) = pool_status(gateway, "broken")["endpoints"]
        failed = endpoint["state"] == "dead" and "crash loop" in (endpoint["reason"] or "")
        return endpoint if failed else None

    endpoint = wait_for(dead, timeout_s=START_TIMEOUT_S, what="the crash")
    assert "ValueError: No common block size for 16" in endpoint["reason"]
    assert endpoint["log_tail"][0].startswith("error: ValueError: No common block size for 16")
    assert "See root cause above" in " ".join(endpoint["log_tail"])  # where the plain tail would have ended


def test_kill_9_of_the_gateway_takes_its_engine_along_and_leaves_the_static_one(
    warm_engine: dict[str, Any], model_dir: Path, gateway: Gateway
) -> None:
    gateway.stop()  # the module's other gateway: at most two engines at once
    gw = start_gateway(
        warm_engine["workdir"] / "gw-kill",
        pools=[launched_pool(model_dir), {**static_pool(warm_engine), "name": "static", "model": "other"}],
        policies={**POLICIES, "models": {MODEL: {}, "other": {}}},
        ready_timeout_s=START_TIMEOUT_S,
        backends=backends_settings(),
    )
    try:
        launched = next(p for p in admin_backends(gw.url)["pools"] if p["name"] == "tiny")
        leader = int(launched["endpoints"][0]["pid"])
        assert group_has_live_members(leader)
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(30)
        # PR_SET_PDEATHSIG: the kernel SIGTERMs the engine, which stops its EngineCore and worker.
        wait_for(lambda: not group_has_live_members(leader), timeout_s=120, what="the engine to follow its gateway")
        assert http_get(warm_engine["server"].url + "/health")[0] == 200  # not the gateway's to stop
    finally:
        if gw.proc.poll() is None:
            gw.stop()
