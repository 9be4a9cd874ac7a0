"""How much of a request's latency no predictor can know when it is dispatched.

    .venv/bin/python -m bench.predictor.floor [RAW] [OUT]   (defaults: var/bench/predictor-raw.json,
                                                              bench/results/predictor-floor.md)

Reads the outcomes a predictor benchmark run exported (`GET /admin/predictor/samples`: each
request's dispatch time, endpoint, prompt and output length, measured TTFT and TPOT) and replays
each endpoint's requests offline through the simulated engine's own scheduler and step-time model
(`sim`), in engine time:

1. **Replay with the real arrivals.** How well does the engine's own model, given every request's
   exact dispatch time, reproduce what was measured? What it misses is the testbed's timing noise
   (a request that reaches the engine just before or just after a step boundary waits a whole step
   more or less), which no predictor at the gateway can see either.
2. **Replay with other futures.** For a sample of requests, keep everything up to and including
   the request exactly as it was, and replace the arrivals after it by those of other windows of the
   same run (same load, same trace): 8 to 24 engine seconds later or earlier. A request's latency
   then varies only with what arrived after it was dispatched. The mean |latency - median| / latency
   over those five futures (its real one and four borrowed) is about the MAPE of a predictor that
   knew the engine's exact state and scheduler, and everything about the workload except the
   arrivals still to come (under it: the median of five draws is itself one of them, and fits them
   better than any forecast; for log-normal draws the spread reads `SPREAD_OF_FIVE` of that MAPE).
3. **Replay with futures like the present.** As 2, but the borrowed windows are the ones (anywhere
   in the run, at least `MATCH_MIN_SHIFT_S` away) whose previous `MATCH_LOOKBACK_S` held the most
   nearly the same arrivals and prompt tokens as the request's own: the futures a forecaster that
   knows the recent rate cannot tell apart. If the spread stays, knowing the rate is not enough.

None of it uses gateway code: it measures the workload, not the predictor.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from backends.perf.roofline import StepTimer
from bench.predictor import report
from sim.config import EngineConfig, build_engine_config
from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler

PRESET = "llama-3.1-8b@h100"
FUTURE_SHIFTS_S = (-24.0, 24.0, -16.0, 16.0, -8.0, 8.0)  # engine seconds: where borrowed futures come from
FUTURES = 4  # borrowed futures per request (the first shifts that fit), plus its real one
HORIZON_S = 20.0  # a future must hold this many seconds of real arrivals (a request lives 5-20 s)
SAMPLED_PER_RUN = 60
SPREAD_OF_FIVE = 0.83  # mean |draw - median| / draw of 5 log-normal draws over the best guess's MAPE
MATCH_LOOKBACK_S = 10.0  # engine seconds of the present a rate-matched future must resemble
MATCH_MIN_SHIFT_S = 8.0  # a rate-matched future starts at least this far from the request (as the fixed shifts)
MATCH_GRID_S = 0.5  # where rate-matched futures may start: every this many engine seconds
Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Trace:
    """One endpoint's requests of one run, in engine seconds from the first dispatch."""

    arrival_s: Array
    prompt: npt.NDArray[np.int64]
    output: npt.NDArray[np.int64]
    ttft_s: Array  # measured (NaN when not observed)
    tpot_s: Array


def replay(
    trace_arrival_s: Array,
    prompt: npt.NDArray[np.int64],
    output: npt.NDArray[np.int64],
    config: EngineConfig,
    on_arrival: Callable[[Scheduler, Request, float], None] | None = None,
) -> tuple[Array, Array]:
    """(TTFT, TPOT) in seconds of every request when these arrivals meet one fresh engine: the
    simulated engine's loop without its clock (a step starts when the last one ended, or at the
    arrival that wakes an idle engine; a request arriving mid-step waits for the next).

    `on_arrival(scheduler, request, now)` sees the engine as each request joins its queue (request
    ids are the indices of the inputs), e.g. to copy its state there (engine_clock.py)."""
    kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens)
    step_time = StepTimer(config.preset)
    token = itertools.count(1)  # unique prompt tokens: no prefix sharing (the Azure trace has none)
    requests = [
        Request(str(i), [next(token) for _ in range(int(p))], [0] * int(o), "length", float(a), int(o))
        for i, (a, p, o) in enumerate(zip(trace_arrival_s, prompt, output, strict=True))
    ]
    pending = sorted(requests, key=lambda r: r.arrival_s)
    k = 0
    now = 0.0
    while k < len(pending) or scheduler.has_work():
        if not scheduler.has_work():
            now = max(now, pending[k].arrival_s)
        while k < len(pending) and pending[k].arrival_s <= now:
            scheduler.add(pending[k])
            if on_arrival is not None:
                on_arrival(scheduler, pending[k], now)
            k += 1
        end = run_step(scheduler, step_time, now)
        if end is None:
            if k == len(pending):
                break
            now = max(now, pending[k].arrival_s)
            continue
        now = end
    ttft = np.array([r.first_token_s - r.arrival_s if r.first_token_s is not None else np.nan for r in requests])
    tpot = np.array(
        [
            (r.last_token_s - r.first_token_s) / (r.num_output - 1)
            if r.num_output > 1 and r.first_token_s is not None and r.last_token_s is not None
            else np.nan
            for r in requests
        ]
    )
    return ttft, tpot


def run_step(scheduler: Scheduler, step_time: StepTimer, now_s: float) -> float | None:
    """Schedule, time and complete one step starting at `now_s`; its end, or None with nothing to run."""
    step = scheduler.schedule(now_s)
    if step.empty:
        return None
    end_s = now_s + step_time([(n, c) for _, n, c in step.prefills], len(step.decodes), step.decode_context_sum)
    scheduler.complete_step(step, end_s)
    return end_s


def traces(run: dict[str, Any], pool: str, time_scale: float) -> dict[str, Trace]:
    """Per endpoint, the run's exported outcomes as engine-time traces."""
    outcomes = [o for o in run.get("samples", {}).get(pool, []) if o["predicted_at_s"] is not None]
    found: dict[str, Trace] = {}
    for endpoint in sorted({o["endpoint"] for o in outcomes}):
        mine = sorted((o for o in outcomes if o["endpoint"] == endpoint), key=lambda o: o["predicted_at_s"])
        dispatched = np.array([o["predicted_at_s"] for o in mine]) * time_scale

        def ms(key: str, rows: list[dict[str, Any]] = mine) -> Array:
            return np.array([o[key] if o[key] is not None else np.nan for o in rows]) * time_scale / 1e3

        found[endpoint] = Trace(
            arrival_s=dispatched - dispatched[0] + 1.0,
            prompt=np.array([round(o["features"]["input_tokens"]) for o in mine], dtype=np.int64),
            output=np.array([round(o["features"]["output_tokens"]) for o in mine], dtype=np.int64),
            ttft_s=ms("ttft_ms"),
            tpot_s=ms("tpot_ms"),
        )
    return found


def mean_ape(predicted: Array, actual: Array, keep: npt.NDArray[np.bool_]) -> float:
    """Mean absolute percentage error (a fraction) over the kept, finite pairs; NaN when none."""
    ok = keep & np.isfinite(predicted) & np.isfinite(actual) & (actual > 0)
    return float(np.mean(np.abs(predicted[ok] - actual[ok]) / actual[ok])) if ok.any() else float("nan")


def measured(trace: Trace, warmup_s: float, cooldown_s: float) -> npt.NDArray[np.bool_]:
    """The requests the benchmark's statistics count (arrivals after the warm-up, before the cool-down)."""
    since_start = trace.arrival_s - trace.arrival_s[0]
    keep: npt.NDArray[np.bool_] = (since_start >= warmup_s) & (trace.arrival_s <= trace.arrival_s[-1] - cooldown_s)
    return keep


def replay_error(trace: Trace, config: EngineConfig, keep: npt.NDArray[np.bool_]) -> tuple[float, float]:
    """MAPE of the exact-arrival replay against what was measured (TTFT, TPOT)."""
    ttft, tpot = replay(trace.arrival_s, trace.prompt, trace.output, config)
    return mean_ape(ttft, trace.ttft_s, keep), mean_ape(tpot, trace.tpot_s, keep)


def _fitting_shifts(trace: Trace, index: int) -> list[float]:
    """The fixed shifts whose borrowed window lies inside the run."""
    arrival = trace.arrival_s
    t_r = arrival[index]
    return [x for x in FUTURE_SHIFTS_S if arrival[0] <= t_r + x and t_r + x + HORIZON_S <= arrival[-1]][:FUTURES]


def _present(trace: Trace, at_s: Array) -> tuple[Array, Array]:
    """Arrivals and prompt tokens in the `MATCH_LOOKBACK_S` before each of `at_s`."""
    arrival = trace.arrival_s
    tokens = np.concatenate([[0], np.cumsum(trace.prompt)])
    lo = np.searchsorted(arrival, at_s - MATCH_LOOKBACK_S)
    hi = np.searchsorted(arrival, at_s)
    return (hi - lo).astype(np.float64), (tokens[hi] - tokens[lo]).astype(np.float64)


def _rate_matched_shifts(trace: Trace, index: int) -> list[float]:
    """`FUTURES` shifts to windows whose recent past most resembles the request's (arrivals and prompt
    tokens over `MATCH_LOOKBACK_S`, each relative to the request's own), none within `MATCH_MIN_SHIFT_S`."""
    arrival = trace.arrival_s
    t_r = arrival[index]
    starts = np.arange(arrival[0] + MATCH_LOOKBACK_S, arrival[-1] - HORIZON_S, MATCH_GRID_S)
    starts = starts[np.abs(starts - t_r) >= MATCH_MIN_SHIFT_S]
    if len(starts) == 0:
        return []
    count, tokens = np.log1p(_present(trace, np.append(starts, t_r)))  # the request's own present last
    distance = np.abs(count[:-1] - count[-1]) + np.abs(tokens[:-1] - tokens[-1])
    chosen: list[float] = []
    for i in np.argsort(distance, kind="stable"):  # nearest first, at least a horizon's tenth apart
        if all(abs(starts[i] - t_r - c) >= HORIZON_S / 10 for c in chosen):
            chosen.append(float(starts[i] - t_r))
        if len(chosen) == FUTURES:
            break
    return chosen


def future_spread(
    trace: Trace, config: EngineConfig, index: int, shifts: list[float] | None = None
) -> tuple[Array, Array]:
    """Request `index`'s (TTFT, TPOT) under its real future and borrowed ones: the arrivals of the
    `HORIZON_S` after t_r + shift, moved to start at t_r (`shifts`; default: the fixed ones that fit)."""
    arrival = trace.arrival_s
    t_r = arrival[index]
    past = np.flatnonzero(arrival < t_r)
    ttfts: list[float] = []
    tpots: list[float] = []
    for shift in (0.0, *(_fitting_shifts(trace, index) if shifts is None else shifts)):
        source = np.flatnonzero(arrival > t_r + shift)
        source = source[source != index]
        future_at = arrival[source] - shift
        keep = future_at > t_r
        chosen = np.concatenate([past, [index], source[keep]])
        at = np.concatenate([arrival[past], [t_r], future_at[keep]])
        ttft, tpot = replay(at, trace.prompt[chosen], trace.output[chosen], config)
        ttfts.append(ttft[len(past)])
        tpots.append(tpot[len(past)])
    return np.array(ttfts), np.array(tpots)


def _spread(draws: Array) -> float:
    """Mean |draw - median| / draw: the relative error of the best single guess among the draws."""
    if not np.all(np.isfinite(draws)):
        return float("nan")
    return float(np.mean(np.abs(draws - np.median(draws)) / draws))


def _mean_and_error(key: str, spreads: list[float]) -> dict[str, float]:
    """The mean of per-request spreads and its standard error (`key`, `key_se`)."""
    values = np.array(spreads)
    values = values[np.isfinite(values)]
    if len(values) < 2:
        return {key: float(np.mean(values)) if len(values) else float("nan"), f"{key}_se": float("nan")}
    return {key: float(np.mean(values)), f"{key}_se": float(np.std(values, ddof=1) / np.sqrt(len(values)))}


def analyse_run(run: dict[str, Any], args: dict[str, Any], pool: str, sampled: int) -> dict[str, Any] | None:
    """One gate-off Azure run's row (None for the other runs: Mooncake shares prefixes, which the replay
    assumes away; gated runs queue and shed)."""
    if not run["name"].startswith("azure") or run.get("mode") != "off":
        return None
    time_scale = float(args.get("time_scale", 1.0))
    warmup_s = float(args.get("skip_warmup_s", 15.0))
    cooldown_s = float(args.get("skip_cooldown_s", 0.0))
    config = build_engine_config(PRESET)
    started = time.perf_counter()
    per_endpoint = traces(run, pool, time_scale)
    if not per_endpoint:
        return None
    replay_ttft, replay_tpot, spread_ttft, spread_tpot, matched_ttft, matched_tpot = [], [], [], [], [], []
    for trace in per_endpoint.values():
        ttft_err, tpot_err = replay_error(trace, config, measured(trace, warmup_s, cooldown_s))
        replay_ttft.append(ttft_err)
        replay_tpot.append(tpot_err)
    trace = next(iter(per_endpoint.values()))  # borrowed futures on one endpoint (they are costly)
    candidates = np.flatnonzero(
        measured(trace, warmup_s, cooldown_s) & (trace.arrival_s <= trace.arrival_s[-1] - HORIZON_S)
    )  # whole real future
    for index in candidates[np.linspace(0, len(candidates) - 1, min(sampled, len(candidates))).astype(int)]:
        ttfts, tpots = future_spread(trace, config, int(index))
        spread_ttft.append(_spread(ttfts))
        spread_tpot.append(_spread(tpots))
        ttfts, tpots = future_spread(trace, config, int(index), _rate_matched_shifts(trace, int(index)))
        matched_ttft.append(_spread(ttfts))
        matched_tpot.append(_spread(tpots))
    online = report.summarize(run, args)["accuracy"]
    result = {
        "run": run["name"],
        "online_ttft": online["ttft_mape"],
        "online_tpot": online["tpot_mape"],
        "load": run.get("load"),
        "requests": sum(len(t.arrival_s) for t in per_endpoint.values()),
        "replay_ttft_mape": float(np.nanmean(replay_ttft)),
        "replay_tpot_mape": float(np.nanmean(replay_tpot)),
        **_mean_and_error("future_ttft", spread_ttft),
        **_mean_and_error("future_tpot", spread_tpot),
        **_mean_and_error("matched_ttft", matched_ttft),
        **_mean_and_error("matched_tpot", matched_tpot),
        "sampled": len(spread_tpot),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(result, flush=True)
    return result


def analyse(raw: dict[str, Any], pool: str = "llama", sampled: int = SAMPLED_PER_RUN) -> list[dict[str, Any]]:
    """Every run's row, the runs replayed in parallel (one process per CPU: each replay is pure Python)."""
    args = raw.get("args", {})
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as workers:
        jobs = [workers.submit(analyse_run, run, args, pool, sampled) for run in raw["runs"]]
        rows = [job.result() for job in jobs]
    return [row for row in rows if row is not None]


def render(results: list[dict[str, Any]], raw_path: Path) -> str:
    lines = [
        "# What a predictor cannot know at dispatch",
        "",
        f"Generated by `bench/predictor/floor.py` from `{raw_path}` (the outcomes a predictor benchmark run "
        "exported). See the module docstring for the method; all of it is offline replay through the simulated "
        "engine's own scheduler and step-time model, in engine time.",
        "",
        "| run | requests | predictor online MAPE: TTFT | TPOT | exact replay vs measured: TTFT | TPOT "
        "| other futures, spread: TTFT | TPOT | futures like the present: TTFT | TPOT | requests sampled |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def spread(r: dict[str, Any], key: str) -> str:
        return f"{100 * r[key]:.1f} ± {100 * r[f'{key}_se']:.1f} %"

    lines += [
        f"| {r['run']} | {r['requests']} | {r['online_ttft']:.1f} % | {r['online_tpot']:.1f} % "
        f"| {100 * r['replay_ttft_mape']:.1f} % | {100 * r['replay_tpot_mape']:.1f} % "
        f"| {spread(r, 'future_ttft')} | {spread(r, 'future_tpot')} "
        f"| {spread(r, 'matched_ttft')} | {spread(r, 'matched_tpot')} | {r['sampled']} |"
        for r in results
    ]
    lines += [
        "",
        "- *Predictor online MAPE*: the gateway's predictions, made at dispatch, against the client's measurements "
        "(the same statistic and requests as `predictor.md`).",
        "- *Replay vs measured*: the engine's own model fed every request's exact dispatch time. TPOT comes back "
        "almost exactly (a request's TPOT is decided by the arrivals around it and nothing else); TTFT does not, "
        "because whether a request reaches the engine just before or just after a step boundary (a matter of a "
        "millisecond of host and network timing) changes its TTFT by a whole step, and the replay's step "
        "boundaries drift from the engine's; the gateway sees the real ones (the time since its last relayed "
        "token), so this is no bound on TTFT.",
        "- *Other futures*: the same request, the same engine state when it arrived, and the arrivals after it "
        "borrowed from other windows of the same run. The spread is roughly the MAPE of a predictor that knew "
        "everything about the engine at dispatch but not what arrives next (an estimate, not a bound: borrowed "
        "windows mix calm and bursty stretches, which the present partly tells apart). ± is the standard error "
        "over the sampled requests.",
        "- *Futures like the present*: the same, borrowing only windows whose previous "
        f"{MATCH_LOOKBACK_S:g} s held about as many arrivals and prompt tokens as the request's own: what a "
        "predictor that also knew the recent arrival rate and mix could not tell apart.",
        "- Both spreads read low: for independent log-normal draws, the mean |draw - median| / draw of five reads "
        f"{SPREAD_OF_FIVE:.2f}x the MAPE of the best single guess (Monte Carlo, for spreads of 5-12 %); divide by "
        "it for an estimate of that MAPE.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    raw_path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("var/bench/predictor-raw.json")
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("bench/results/predictor-floor.md")
    raw = json.loads(raw_path.read_text(encoding="utf-8"))
    results = analyse(raw)
    out.write_text(render(results, raw_path), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
