"""Summaries of one replay: latency percentiles, throughput, cache hit rate (engine counters)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TTFT_GOOD_S = 2.0  # "share of requests with TTFT <= 2 s"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class RunSummary:
    trace: str
    load: float  # fraction of the measured capacity
    router: str
    offered_rps: float  # simulated seconds
    requests: int
    ok: int
    ttft_p50_s: float  # engine-reported, simulated seconds
    ttft_p90_s: float
    ttft_p99_s: float
    client_ttft_p50_s: float  # client-observed real seconds x time scale
    client_ttft_p90_s: float
    client_ttft_p99_s: float
    tpot_p50_ms: float  # engine-reported
    tpot_p90_ms: float
    client_tpot_p50_ms: float
    client_tpot_p90_ms: float
    throughput_rps: float  # completed requests per simulated second
    output_tps: float  # generated tokens per simulated second
    cache_hit_rate: float  # engines' prefix-cache hits / queries (tokens), over the run
    ttft_good_share: float  # engine TTFT <= TTFT_GOOD_S
    client_ttft_good_share: float
    max_client_lag_s: float  # worst lateness of a send vs its schedule (real seconds)
    host_cpu_busy: float  # share of all host CPU time busy during the replay
    per_engine: list[int]
    queue_p90_s: float = float("nan")  # engine-reported time waiting for the first schedule (simulated)
    seed: int = 7  # the round (Mooncake subset, prompt words, router RNG); 7 before rounds existed

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def summarize(
    *,
    trace: str,
    load: float,
    router: str,
    offered_rps: float,
    outcomes: Sequence[dict[str, Any]],
    wall_s: float,
    time_scale: float,
    cache_hit_rate: float,
    per_engine: list[int],
    host_cpu_busy: float,
    seed: int = 7,
) -> RunSummary:
    ok = [o for o in outcomes if o["ok"]]
    ttft = [o["engine"].get("ttft_s", float("nan")) for o in ok]
    client_ttft = [o["ttft_s"] * time_scale for o in ok]
    tpot = [o["engine"].get("tpot_s", 0.0) * 1000 for o in ok if o["completion_tokens"] > 1]
    client_tpot = [o["tpot_s"] * time_scale * 1000 for o in ok if o["tpot_s"]]
    sim_s = max(wall_s * time_scale, 1e-9)
    tokens = sum(o["completion_tokens"] for o in ok)
    return RunSummary(
        trace=trace,
        load=load,
        router=router,
        offered_rps=offered_rps,
        requests=len(outcomes),
        ok=len(ok),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        client_ttft_p50_s=percentile(client_ttft, 50),
        client_ttft_p90_s=percentile(client_ttft, 90),
        client_ttft_p99_s=percentile(client_ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p90_ms=percentile(tpot, 90),
        client_tpot_p50_ms=percentile(client_tpot, 50),
        client_tpot_p90_ms=percentile(client_tpot, 90),
        throughput_rps=len(ok) / sim_s,
        output_tps=tokens / sim_s,
        cache_hit_rate=cache_hit_rate,
        ttft_good_share=sum(1 for t in ttft if t <= TTFT_GOOD_S) / len(outcomes) if outcomes else 0.0,
        client_ttft_good_share=sum(1 for t in client_ttft if t <= TTFT_GOOD_S) / len(outcomes) if outcomes else 0.0,
        max_client_lag_s=max((o["late_s"] for o in outcomes), default=0.0),
        host_cpu_busy=host_cpu_busy,
        per_engine=per_engine,
        queue_p90_s=queue_p90(outcomes),
        seed=seed,
    )


def queue_p90(outcomes: Sequence[dict[str, Any]]) -> float:
    return percentile([o["engine"].get("queue_s", 0.0) for o in outcomes if o["ok"]], 90)


def capacity_from_burst(outcomes: Sequence[dict[str, Any]], time_scale: float, share: float = 0.8) -> float:
    """Completed requests per simulated second while the fleet was saturated by an all-at-once burst:
    `share` of the requests over the time their `share`-quantile finished (the tail, when the fleet
    drains with little left to batch, is left out)."""
    done = sorted(o["scheduled_s"] + o["late_s"] + o["e2e_s"] for o in outcomes if o["ok"])
    if not done:
        raise RuntimeError("capacity burst: no request succeeded")
    start = min(o["scheduled_s"] + o["late_s"] for o in outcomes)
    k = max(1, int(share * len(done)))
    return float(k / ((done[k - 1] - start) * time_scale))


def ttft_floors(prompts: Sequence[tuple[int, int]], preset: str, chunk_tokens: int = 8192) -> list[float]:
    """Per request (prompt tokens, best-case cached tokens), its TTFT alone on an idle engine: the
    uncached part prefilled in `chunk_tokens` steps (the simulator's step-time model). With every
    earlier-seen block counted as cached, no router can beat it: the p90 of these is the floor a
    routing target has to sit above."""
    from backends.perf.presets import resolve_preset
    from backends.perf.roofline import step_time_s

    spec = resolve_preset(preset, None)
    out = []
    for prompt, cached in prompts:
        done = min(max(cached, 0), max(prompt - 1, 0))
        total = 0.0
        while done < prompt:
            n = min(chunk_tokens, prompt - done)
            total += step_time_s(spec, [(n, done)])
            done += n
        out.append(total)
    return out
