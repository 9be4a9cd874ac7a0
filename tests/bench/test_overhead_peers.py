"""bench.overhead.peers without the peers installed: the CPU accounting of a process tree, the
fixed-count client and the report's ratios (the bench itself needs LiteLLM and Portkey; tests never do)."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest
from aiohttp import web

from bench.overhead.peers import BARE, Point, _tree, load, render, summarize, tree_cpu_seconds

SPIN = "import sys\nx = 0\nfor i in range(3_000_000):\n    x += i\nprint('done', flush=True)\nsys.stdin.read()\n"


@pytest.mark.e2e  # starts a process and its child
def test_tree_cpu_counts_a_child_process_the_parent_spawned() -> None:
    """LiteLLM and nginx serve from children: the child's CPU must land in the parent's figure."""
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {SPIN!r}])"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == b"done"  # the child finished its loop and waits
        tree = _tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        child_precise, child_ticks = tree_cpu_seconds(tree[1])
        whole_precise, whole_ticks = tree_cpu_seconds(parent.pid)
        assert child_precise > 0
        assert whole_precise >= child_precise and whole_ticks >= child_ticks
    finally:
        parent.kill()
        parent.wait(10)


def test_load_sends_the_fixed_number_of_requests_and_counts_the_200s() -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True}, status=200 if len(seen) % 5 else 500)

    async def scenario() -> Point:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            return await load(url, b'{"model":"m"}', {"Content-Type": "application/json"}, 20, 3)
        finally:
            await runner.cleanup()

    point = asyncio.run(scenario())
    assert len(seen) == 20 and set(seen) == {b'{"model":"m"}'}
    assert point.requests == 20 and point.ok == 16  # every fifth answer was a 500


def _point(target: str, workload: str, round_: int, cpu: float, rps: float) -> Point:
    return Point(target, workload, round_, 100, 100, rps, 1.0, cpu, cpu)


def test_report_gives_ratios_to_the_bare_pass_through_and_the_round_range() -> None:
    points = [
        _point(BARE, "short", 1, 0.2, 1000),
        _point(BARE, "short", 2, 0.3, 900),
        _point("tokenway (full policy)", "short", 1, 0.5, 600),
        _point("tokenway (full policy)", "short", 2, 0.7, 500),
        _point("LiteLLM proxy 9.9", "short", 1, 10.0, 50),
        _point("LiteLLM proxy 9.9", "short", 2, 14.0, 40),
    ]
    summary = summarize(points)
    assert abs(summary[("tokenway (full policy)", "short")]["cpu_ratio"] - 0.6 / 0.25) < 1e-9
    assert abs(summary[("LiteLLM proxy 9.9", "short")]["rps_ratio"] - 45 / 950) < 1e-9
    args = argparse.Namespace(
        rounds=2, short_requests=100, long_requests=10, connections=8, idle_seconds=5, prewarm_short=9, prewarm_long=1
    )
    text = render(points, {"tokenway (full policy)": 16.0}, args, {"litellm": "9.9"}, (1.0, 1, 1), (2.0, 2, 2))
    assert "| short | tokenway (full policy) | 0.600 | 0.500-0.700 | 0.600 | 2.40x |" in text
    assert "- short: tokenway / LiteLLM proxy 9.9 = 0.05x" in text
    assert "| tokenway (full policy) | 16.00 |" in text
