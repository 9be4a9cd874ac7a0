"""Whose doing is a missed interactive request beside a batch: what the batch was doing when it came.

`BatchSampler` polls the gateway's batch gauges (`tokenway_batch_lines_in_flight` and the finished
lines) every `interval_s` while the interactive window is replayed; `miss_rows` then says, for the
measured requests that missed their objectives and for all of them, how many batch lines were in
flight at the send time and how many had started in the TTFT objective before it (the lines whose
prefill could stand in front of the request). Misses the batch causes show more of both than the
average request; misses that happen alone as well (repeat the run without the batch) are the
workload's own tail.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from typing import Any

import aiohttp

from bench.predictor import report

_FINISHED = ("tokenway_batch_lines_total",)


class BatchSampler:
    def __init__(self, base_url: str, interval_s: float = 0.1) -> None:
        self.url = base_url + "/metrics"
        self.interval_s = interval_s
        self.points: list[tuple[float, int, int]] = []  # (s since start, in flight, finished)
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0

    def start(self, started_s: float) -> None:
        self._started = started_s
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[tuple[float, int, int]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.points

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                        text = await response.text()
                    in_flight = finished = 0
                    for line in text.splitlines():
                        if line.startswith("tokenway_batch_lines_in_flight "):
                            in_flight = int(float(line.rpartition(" ")[2]))
                        elif line.startswith(_FINISHED):
                            finished += int(float(line.rpartition(" ")[2]))
                    self.points.append((time.perf_counter() - self._started, in_flight, finished))
                await asyncio.sleep(self.interval_s)


def _at(points: list[tuple[float, int, int]], times: list[float], t: float) -> tuple[int, int]:
    """(in flight, started so far) at `t`: the last sample at or before it."""
    i = bisect.bisect_right(times, t) - 1
    if i < 0:
        return 0, 0
    _, in_flight, finished = points[i]
    return in_flight, in_flight + finished


def miss_rows(run: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Misses of the measured window, by kind, and the batch around misses vs around every request."""
    ts = args["time_scale"]
    rows = run["rows"]
    first, last = report.measured_window(rows, args)
    rows = [r for r in rows if first <= r["scheduled_s"] <= last]
    points = run.get("batch_samples") or []
    times = [p[0] for p in points]
    window_wall = args["ttft_slo_ms"] / 1000 / ts  # the TTFT objective, in wall seconds

    def kind(r: dict[str, Any]) -> str | None:
        if r["status"] != 200 or r["ttft_s"] is None:
            return "error"
        if r["ttft_s"] * 1000 * ts > args["ttft_slo_ms"]:
            return "ttft"
        if r["tpot_s"] is not None and r["tpot_s"] * 1000 * ts > args["tpot_slo_ms"]:
            return "tpot"
        return None

    def around(subset: list[dict[str, Any]]) -> tuple[float | None, float | None]:
        if not subset or not points:
            return None, None
        flights, starts = [], []
        for r in subset:
            in_flight, started = _at(points, times, r["scheduled_s"])
            flights.append(in_flight)
            starts.append(started - _at(points, times, r["scheduled_s"] - window_wall)[1])
        return sum(flights) / len(flights), sum(starts) / len(starts)

    missed = [r for r in rows if kind(r) is not None]
    kinds: dict[str, int] = {}
    for r in missed:
        k = kind(r)
        assert k is not None
        kinds[k] = kinds.get(k, 0) + 1
    return {
        "measured": len(rows),
        "missed": len(missed),
        "kinds": kinds,
        "missed_ttft_ms": sorted(round(r["ttft_s"] * 1000 * ts) for r in missed if r["ttft_s"] is not None),
        "around_missed": around(missed),
        "around_all": around(rows),
        "engine_queue_ms_missed": _mean([r["engine"].get("queue_s", 0) * 1000 for r in missed if r.get("engine")]),
        "engine_queue_ms_all": _mean([r["engine"].get("queue_s", 0) * 1000 for r in rows if r.get("engine")]),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def report_lines(runs: list[tuple[str, dict[str, Any]]], args: dict[str, Any]) -> list[str]:
    """The report's section on the misses of each run."""
    ttft = args["ttft_slo_ms"]
    lines = [
        "## The misses: the batch's doing, or the workload's own tail?",
        "",
        f"Per run, the measured interactive requests that missed (TTFT over {ttft:.0f} ms, TPOT over "
        f"{args['tpot_slo_ms']:.0f} ms, or an error), and — sampled from the gateway's batch gauges every "
        f"0.1 s wall — the batch lines in flight when each was sent and those started in the {ttft:.0f} ms "
        "(engine) before it, for the misses and for every measured request. The engine's own queueing "
        "(the simulator's `queue_s`) is in engine ms.",
        "",
        "| run | measured | missed (ttft / tpot / error) | missed TTFT ms | batch in flight: missed / all "
        "| batch started just before: missed / all | engine queue ms: missed / all |",
        "| --- | ---: | --- | --- | --- | --- | --- |",
    ]
    for name, m in runs:
        k = m["kinds"]
        flights = " / ".join(report._f(x, 1) for x in (m["around_missed"][0], m["around_all"][0]))
        starts = " / ".join(report._f(x, 2) for x in (m["around_missed"][1], m["around_all"][1]))
        queue = " / ".join(report._f(x, 1) for x in (m["engine_queue_ms_missed"], m["engine_queue_ms_all"]))
        shown = ", ".join(str(x) for x in m["missed_ttft_ms"][:12]) + (" …" if len(m["missed_ttft_ms"]) > 12 else "")
        lines.append(
            f"| {name} | {m['measured']} | {m['missed']} ({k.get('ttft', 0)} / {k.get('tpot', 0)} / "
            f"{k.get('error', 0)}) | {shown} | {flights} | {starts} | {queue} |"
        )
    return [*lines, ""]
