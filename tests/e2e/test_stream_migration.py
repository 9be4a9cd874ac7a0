"""Streams that survive their replica: `kill -9` of an engine mid-stream, under load.

With `migrate_streams` (the default for launched pools) every stream continues on the other
replica and the client sees one stream, with the output it asked for and usage counted once; with
it off, the streams on the killed replica end with the error event.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.polling import wait_for
from tests.support.procs import TEST_KEY, Gateway, free_port, http_get, metric_total, policies_doc, start_gateway

pytestmark = pytest.mark.e2e


def ports() -> dict[str, int]:
    """Port bases of our own (the defaults are shared by every gateway on this host)."""
    return {name: free_port() for name in ("port_base", "kv_events_port_base", "kv_events_replay_port_base",
                                            "kv_transfer_port_base")}  # fmt: skip


MODEL = "llama-3.1-8b"
STREAMS = 6
MAX_TOKENS = 400


def pool(migrate: bool) -> dict[str, Any]:
    return {
        "name": "llama",
        "model": MODEL,
        "engine": "sim",
        "preset": "llama-3.1-8b@h100",
        "replicas": 2,
        "migrate_streams": migrate,
        "ready_timeout_s": 60,
    }


class Stream:
    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.text = ""
        self.chunks = 0
        self.usage: Any = None
        self.finish: str | None = None
        self.error: str | None = None
        self.ids: set[str] = set()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.ids.add(chunk.id)
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.text += choice.delta.content
                        self.chunks += 1
                    if choice.finish_reason:
                        self.finish = choice.finish_reason
        except Exception as exc:
            self.error = repr(exc)


def kill_busiest(gw: Gateway) -> str:
    _, body = http_get(gw.url + "/admin/backends")
    endpoints = json.loads(body)["pools"][0]["endpoints"]
    victim = max(endpoints, key=lambda e: e["inflight_requests"])
    os.killpg(victim["pid"], signal.SIGKILL)
    return str(victim["id"])


@pytest.mark.parametrize("migrate", [True, False], ids=["migrate", "no-migrate"])
def test_streams_cut_by_a_kill(tmp_path: Path, migrate: bool) -> None:
    gw = start_gateway(
        tmp_path,
        pools=[pool(migrate)],
        policies=policies_doc(models={MODEL: {"default_max_tokens": 1024}}),
        backends={"log_dir": str(tmp_path / "logs"), "run_dir": str(tmp_path / "run"), **ports()},
    )
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=120)
        streams = [Stream(client) for _ in range(STREAMS)]
        for stream in streams:
            stream.thread.start()
        wait_for(lambda: all(s.chunks >= 5 for s in streams), what="every stream to be under way", timeout_s=90)
        killed = kill_busiest(gw)
        for stream in streams:
            stream.thread.join(120)
        cut = [s for s in streams if s.error is not None or s.finish != "length"]
        if migrate:
            assert cut == [], [s.error for s in cut]
            for s in streams:
                assert len(s.ids) == 1  # one stream id end to end
                assert s.usage.completion_tokens == MAX_TOKENS  # the budget held across the splice
                assert s.usage.prompt_tokens < 100  # the recomputed prefix is not billed as input
            moved = metric_total(gw.url, "tokenway_stream_migrations_total", outcome="migrated")
            assert moved >= 1
        else:
            assert cut, f"no stream was cut by killing {killed}"
            assert all(s.error is not None for s in cut)
    finally:
        gw.stop()
