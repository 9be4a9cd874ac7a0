"""bench/results/autoscale.md and autoscale.png from the runs of bench/autoscale/run.py."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from bench import notes
from bench.autoscale.client import Outcome, Sample


class Run(Protocol):
    mode: str
    outcomes: list[Outcome]
    samples: list[Sample]
    pools: dict[str, Any]
    seed: int


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)
    return ordered[k]


def met(o: Outcome, ttft_s: float, tpot_s: float) -> bool:
    """The SLO on the wall clock at the client (host lag included)."""
    tpot = o.tpot_s
    return o.served and o.ttft_s is not None and o.ttft_s <= ttft_s and (tpot is None or tpot <= tpot_s)


def honest_ttft_s(o: Outcome, time_scale: float, *, queue: bool = True) -> float | None:
    """TTFT on the engine's clock (simulated seconds, converted to wall seconds at the time scale)
    plus every wait inside the gateway: the cold-start hold and, with `queue`, the flow/SLO queue
    before dispatch (`x-tokenway-queued-ms`). Only the host's scheduling lag is left out."""
    if o.engine_ttft_s is None:
        return None
    waited = (o.cold_start_ms or 0.0) + ((o.queued_ms or 0.0) if queue else 0.0)
    return o.engine_ttft_s / time_scale + waited / 1000


def met_engine(o: Outcome, ttft_s: float, tpot_s: float, time_scale: float, *, queue: bool = True) -> bool:
    """The SLO on the engine's clock plus the gateway's waits (`honest_ttft_s`); the host's lag left
    out. Without `queue`: the figure earlier runs reported, which left the flow queue out."""
    ttft = honest_ttft_s(o, time_scale, queue=queue)
    if not o.served or ttft is None:
        return False
    return ttft <= ttft_s and (o.engine_tpot_s or 0.0) / time_scale <= tpot_s


def gpu_seconds(samples: Sequence[Sample], pool: str | None = None, *, asleep: bool = True) -> float:
    """Device-seconds over the run. With `asleep` (the targets' count) a device counts while some
    replica is on it awake or asleep: a replica asleep at sleep level 1 keeps its process and CUDA
    context there, so the device is not another model's unless the budget hands it over (`share:`);
    without it, only the devices of awake replicas count."""
    total = 0.0
    for before, after in itertools.pairwise(samples):
        if pool:
            held = before.awake.get(pool, 0) + (before.asleep.get(pool, 0) if asleep else 0)
        elif asleep and before.held >= 0:
            held = before.held
        else:
            held = sum(before.awake.values()) + (sum(before.asleep.values()) if asleep else 0)
        total += held * (after.at_s - before.at_s)
    return total


def summarise(
    run: Run, slo: dict[str, float], time_scale: float, burst: tuple[float, float] | None = None
) -> dict[str, Any]:
    outcomes = run.outcomes
    ttft, tpot = slo["ttft_s"], slo["tpot_s"]
    cold = [o for o in outcomes if o.cold_start_ms is not None]
    cold_ttft = [o.ttft_s for o in cold if o.ttft_s is not None]
    pools = {p["name"]: p for p in run.pools.get("pools", [])}
    startup = {name: p.get("startup_s", 0.0) for name, p in pools.items()}
    ratios = []
    for o in cold:
        pool = "chat" if o.model.startswith("llama") else "code"
        if startup.get(pool):
            ratios.append((o.cold_start_ms or 0.0) / 1000 / startup[pool])
    events = {name: p.get("scale_events", {}) for name, p in pools.items()}
    start, end = burst if burst is not None else (0.0, 0.0)
    in_burst = [o for o in outcomes if start <= o.sent_s < end]
    rest = [o for o in outcomes if not start <= o.sent_s < end]
    lags = [
        o.ttft_s - honest
        for o in outcomes
        if o.ttft_s is not None and (honest := honest_ttft_s(o, time_scale)) is not None
    ]
    by_model: dict[str, float] = {}
    for model in sorted({o.model for o in outcomes}):
        mine = [o for o in outcomes if o.model == model]
        by_model[model] = sum(met_engine(o, ttft, tpot, time_scale) for o in mine) / len(mine)
    return {
        "mode": run.mode,
        "seed": run.seed,
        "requests": len(outcomes),
        "met": sum(met_engine(o, ttft, tpot, time_scale) for o in outcomes),
        "burst_met": sum(met_engine(o, ttft, tpot, time_scale) for o in in_burst),
        "rest_met": sum(met_engine(o, ttft, tpot, time_scale) for o in rest),
        "rest_requests": len(rest),
        "cold_ratios": ratios,
        "attainment": sum(met_engine(o, ttft, tpot, time_scale) for o in outcomes) / max(len(outcomes), 1),
        "attainment_wall": sum(met(o, ttft, tpot) for o in outcomes) / max(len(outcomes), 1),
        "attainment_unqueued": sum(met_engine(o, ttft, tpot, time_scale, queue=False) for o in outcomes)
        / max(len(outcomes), 1),
        "queued": sum(bool(o.queued_ms) for o in outcomes),
        "queued_p99": percentile([(o.queued_ms or 0.0) / 1000 for o in outcomes], 99),
        "lag_p50": percentile(lags, 50),
        "lag_p99": percentile(lags, 99),
        "by_model": by_model,
        "burst": sum(met_engine(o, ttft, tpot, time_scale) for o in in_burst) / max(len(in_burst), 1),
        "rest": sum(met_engine(o, ttft, tpot, time_scale) for o in rest) / max(len(rest), 1),
        "burst_requests": len(in_burst),
        "gpu_s": gpu_seconds(run.samples),
        "gpu_s_awake": gpu_seconds(run.samples, asleep=False),
        "ttft_p50": percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 50),
        "ttft_p99": percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 99),
        "cold": len(cold),
        "cold_ttft_p50": percentile(cold_ttft, 50),
        "cold_ttft_p99": percentile(cold_ttft, 99),
        "cold_within": sum(r <= 1.1 for r in ratios) / len(ratios) if ratios else None,
        "cold_ratio_max": max(ratios) if ratios else None,
        "cut": sum(o.cut for o in outcomes),
        "rejected": sum(o.status not in (0, 200) for o in outcomes),
        "failed": sum(o.status == 0 for o in outcomes),
        "scale_up": sum(e.get("up", 0) for e in events.values()),
        "scale_down": sum(e.get("down", 0) for e in events.values()),
        "drain_timeouts": sum(p.get("drain_timeouts", 0) for p in pools.values()),
        "startup_s": startup,
        "wake_s": {name: p.get("wake_s", 0.0) for name, p in pools.items()},
        # a wake time is learnt only from wakes; without one the pool reports its default (5 s)
        "wakes": {name: len((p.get("measured") or {}).get("wakes_s") or ()) for name, p in pools.items()},
    }


def pooled(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, its days (seeds) together: attainment over all their requests, GPU-seconds the mean
    of a day, the cut and cold-start figures summed or over all holds, and the spread of the days."""
    out: list[dict[str, Any]] = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        days = [r for r in rows if r["mode"] == mode]
        requests = sum(r["requests"] for r in days)
        ratios = [x for r in days for x in r["cold_ratios"]]
        out.append(
            {
                "mode": mode,
                "days": len(days),
                "seeds": [r["seed"] for r in days],
                "requests": requests,
                "attainment": sum(r["met"] for r in days) / max(requests, 1),
                "day_attainment": [r["attainment"] for r in days],
                "burst": sum(r["burst_met"] for r in days) / max(sum(r["burst_requests"] for r in days), 1),
                "rest": sum(r["rest_met"] for r in days) / max(sum(r["rest_requests"] for r in days), 1),
                "gpu_s": sum(r["gpu_s"] for r in days) / len(days),
                "day_gpu_s": [r["gpu_s"] for r in days],
                "cut": sum(r["cut"] for r in days),
                "rejected": sum(r["rejected"] for r in days),
                "cold": sum(r["cold"] for r in days),
                "cold_within": sum(x <= 1.1 for x in ratios) / len(ratios) if ratios else None,
                "cold_ratio_max": max(ratios) if ratios else None,
            }
        )
    return out


def _load(meta: dict[str, Any]) -> str:
    load = meta.get("load")
    return f"; 1-minute load {load[0]:g} before, {load[1]:g} after" if load else ""


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def _seeds(meta: dict[str, Any]) -> list[int]:
    return list(meta.get("seeds") or [meta.get("seed", 7)])


def _requests(meta: dict[str, Any]) -> str:
    """'865 streamed requests' for one day; per seed for several."""
    found = meta["requests"]
    if isinstance(found, dict):
        if len(found) == 1:
            return f"{next(iter(found.values()))} streamed requests"
        return "streamed requests per day " + ", ".join(f"{n} (seed {s})" for s, n in found.items())
    return f"{found} streamed requests"


def compression(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """The day's compression stated against the start-up: the burst in learnt start-up times, beside
    a real day's (a 5x burst of about 2 h against a 1-2 min start-up: 60-120 start-ups)."""
    burst = meta.get("burst_s")
    starts = [r["startup_s"]["chat"] for r in rows if r["startup_s"].get("chat")]
    if not burst or not starts:
        return ""
    length = burst[1] - burst[0]
    startup = sorted(starts)[len(starts) // 2]
    day = meta["day_s"]
    return (
        f"Time compression: the day of 86,400 s runs in {day:g} s ({86_400 / day:.0f}x), but a replica's start-up "
        f"is not compressed with it: the chat burst lasts {length:.1f} s, {length / startup:.1f} times the learnt "
        f"chat start-up of {startup:.1f} s (wall, median over the modes), where on a real day a 5x burst of "
        f"{length * 86_400 / day / 3600:.1f} h meets a 1-2 min start-up (60-120 start-ups). A planner that "
        "reacts to the burst has its new replicas serving after its first start-up here, a small share of it "
        "there."
    )


def write(
    results: Path,
    meta: dict[str, Any],
    runs: Sequence[Run],
    curve: dict[str, list[tuple[float, float]]],
    extras: dict[str, Any],
    name: str = "autoscale",
) -> None:
    slo = meta["slo"]
    burst = meta.get("burst_s")
    rows = [summarise(r, slo, meta["time_scale"], tuple(burst) if burst else None) for r in runs]
    days = pooled(rows)
    peak = next((r["gpu_s"] for r in days if r["mode"] == "static-peak"), None)
    if peak is None and meta.get("devices"):
        # static-peak holds every device all day, whatever the arrivals: a variant run may leave it out
        peak = float(meta["devices"]) * meta["day_s"]
    seeds = _seeds(meta)
    several = len(seeds) > 1
    lines = [
        "# Elastic pools: a bursty day against 8 simulated GPUs" + (f": {meta['title']}" if meta.get("title") else ""),
        "",
        f"Generated by `{meta.get('command', 'python -m bench.autoscale')}` on {meta['generated']} "
        f"({meta['minutes']} min, {meta['host']}; machine shared with other jobs{_load(meta)}). One day compressed "
        f"into {meta['day_s']:g} s of wall time, {_requests(meta)} for two models (Llama-3.1-8B chat on Azure's "
        "conversation trace with a 5x burst late in the day; Qwen2.5-7B code on Azure's code trace, working "
        "hours only), the same arrivals through a fresh gateway per mode"
        + (
            f"; {len(seeds)} days (seeds {', '.join(map(str, seeds))}: the arrivals and lengths drawn anew, "
            "the rate curve and the burst's window the same), static-peak on the first only (its GPU-s do not "
            "depend on the arrivals)"
            if several
            else ""
        )
        + f". Simulated H100s at time scale {meta['time_scale']:g} (half speed), `max_num_seqs` 8, start-up from "
        f"the weights at {meta.get('load_gbps', 4):g} GB/s + {meta.get('init_s', 2):g} s (simulated). "
        f"Planner pass every {meta['interval_s']:g} s, scale-down stabilisation "
        f"{meta['stabilization_s']:g} s (both planners); the tokens planner gives up one replica per "
        f"scale-down, {meta.get('scale_down_cooldown_s', 10):g} s after any scale event. "
        f"SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= "
        f"{slo['tpot_s'] * 1000:g} ms (wall seconds of the engines' clock: their own TTFT and TPOT, plus every "
        "wait inside the gateway, the cold-start hold and the flow/SLO queue before dispatch; only the host's "
        "scheduling lag left out, as this 2-core host is shared with other jobs; the wall clock at the "
        "client, host lag included, is the third column, and the bench's client pool is unbounded); a "
        "request refused or cut misses it. 'without the queue': the figure runs before 2026-12-02 04:00 "
        "reported, which left the gateway's flow queue out. host lag: the client's TTFT less the honest one. "
        "GPU-s held (what the targets use): the devices that some replica is on, awake (starting, "
        "ready, draining) or asleep, each device once, sampled every second. A replica asleep at sleep level 1 "
        "has its weights in host memory and its KV cache freed, but its process and CUDA context stay on the "
        "device and it can wake only there, so its device is counted as held (the budget may start another "
        "pool's replica on it, which then holds it instead). GPU-s awake: awake replicas only (the count "
        "if an asleep replica's device served something else meanwhile).",
        "",
    ]
    told = compression(meta, rows)
    if told:
        lines += [told, ""]
    if meta.get("variant"):
        lines += [str(meta["variant"]), ""]
    lines += [
        "| mode | seed | SLO attainment | without the queue | at the client | queued (p99 s) | host lag p50 / p99 s | "
        "chat / code | burst / rest | GPU-s held | vs static peak | "
        "GPU-s awake | "
        "TTFT p50 / p99 s | cold starts | cold TTFT p50 / p99 s | held <= start-up +10 % | cut by scale-down | "
        "refused | scale up / down | drain timeouts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        chat_code = " / ".join(f"{100 * v:.1f}" for v in r["by_model"].values())
        ratio = r["gpu_s"] / peak if peak else None
        lines.append(
            f"| {r['mode']} | {r['seed']} | {100 * r['attainment']:.1f} % | {100 * r['attainment_unqueued']:.1f} % | "
            f"{100 * r['attainment_wall']:.1f} % | {r['queued']} ({_fmt(r['queued_p99'])}) | "
            f"{_fmt(r['lag_p50'])} / {_fmt(r['lag_p99'])} | {chat_code} | "
            f"{100 * r['burst']:.1f} / {100 * r['rest']:.1f} | "
            f"{r['gpu_s']:.0f} | {_fmt(ratio)} | {r['gpu_s_awake']:.0f} | "
            f"{_fmt(r['ttft_p50'])} / {_fmt(r['ttft_p99'])} | {r['cold']} | "
            f"{_fmt(r['cold_ttft_p50'])} / {_fmt(r['cold_ttft_p99'])} | "
            f"{_fmt(r['cold_within'], '{:.0%}')} (max {_fmt(r['cold_ratio_max'])}x) | {r['cut']} | {r['rejected']} | "
            f"{r['scale_up']} / {r['scale_down']} | {r['drain_timeouts']} |"
        )
    lines += [
        "",
        (
            "burst / rest: attainment of the chat burst's window ("
            + ", ".join(
                dict.fromkeys(f"{r['burst_requests']} of {r['requests']} requests (seed {r['seed']})" for r in rows)
            )
            + ") and of the rest of the day."
            if rows and burst
            else ""
        ),
        "",
    ]
    if several:
        lines += _pooled_table(days, peak)
    lines += [
        "Where the engine's clock and the client's differed: the simulated engine's TTFT starts when the "
        "engine receives the request, but flow control holds a request in the gateway while every engine of "
        "its pool has `max_engine_waiting` requests waiting (saturated in a burst, or with too few replicas), "
        "and that wait came before. It is in `x-tokenway-queued-ms` and now counts (queued: requests that "
        "waited there, and the p99 of the wait); what is left between the two clocks is the host lag column. "
        "The client's connection pool is unbounded, so nothing waits in the client.",
        "",
        "Learnt start-up / wake-up times per mode (s, wall; '-': no replica woke, the pool has only its "
        "default of 5 s): "
        + "; ".join(
            f"{r['mode']} ({r['seed']}): "
            + ", ".join(
                f"{p} {r['startup_s'][p]:.1f} / " + (f"{r['wake_s'][p]:.2f}" if r["wakes"].get(p) else "-")
                for p in r["startup_s"]
            )
            for r in rows
            if r["startup_s"]
        ),
        "",
    ]
    lines += _targets(days, several, peak)
    lines += notes.section(results / f"{name}.md")
    if extras and meta.get("extras_generated"):
        lines += [
            f"The three short experiments below are those of the run of {meta['extras_generated']} "
            "(not re-run with the day above).",
            "",
        ]
    lines += _extras(extras, slo, meta["time_scale"])
    lines += ["", f"![replicas and offered load]({name}.png)", ""]
    (results / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(results / f"{name}.png", runs, curve)


def _pooled_table(days: Sequence[dict[str, Any]], peak: float | None) -> list[str]:
    lines = [
        "Pooled over the days (what the targets below use): attainment over every request of the mode's days, "
        "GPU-s held the mean of a day.",
        "",
        "| mode | days | SLO attainment | per day | burst / rest | GPU-s held (mean) | per day | vs static peak "
        "| cut by scale-down | cold starts | held <= start-up +10 % |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for d in days:
        per_day = ", ".join(f"{100 * x:.1f}" for x in d["day_attainment"])
        gpu_days = ", ".join(f"{x:.0f}" for x in d["day_gpu_s"])
        ratio = d["gpu_s"] / peak if peak else None
        lines.append(
            f"| {d['mode']} | {d['days']} | {100 * d['attainment']:.1f} % | {per_day} | "
            f"{100 * d['burst']:.1f} / {100 * d['rest']:.1f} | {d['gpu_s']:.0f} | {gpu_days} | {_fmt(ratio)} | "
            f"{d['cut']} | {d['cold']} | {_fmt(d['cold_within'], '{:.0%}')} |"
        )
    return [*lines, ""]


def _targets(rows: Sequence[dict[str, Any]], several: bool = False, peak: float | None = None) -> list[str]:
    """The issue's targets for every tokens-planner mode (pooled over the days when there are several),
    against static-peak's GPU-seconds `peak`."""
    found = {r["mode"]: r for r in rows}
    out = ["## Targets", ""]
    if peak is not None and "static-peak" not in found:
        out += [f"static-peak not run: its GPU-seconds are every device for the whole day ({peak:.0f}).", ""]
    if several:
        out += ["Pooled over each mode's days (the table above).", ""]
    for name in (m for m in found if m.startswith("tokens")):
        mine = found[name]
        if peak is None:
            continue
        if name == "tokens-scheduled":
            out.append(
                f"- {name} is the scheduled (announced) variant: the operator set a floor for the chat burst "
                "through the admin floor API at day start; every other mode is reactive and had no warning"
            )
        share = mine["gpu_s"] / peak
        out.append(
            f"- {name}: attainment {100 * mine['attainment']:.1f} % (target >= 95 %) at {100 * share:.0f} % of "
            f"static-peak GPU-seconds (target <= 60 %): "
            + ("met" if mine["attainment"] >= 0.95 and share <= 0.60 else "not met")
        )
        hpas = [r for r in rows if r["mode"].startswith("hpa")]
        if hpas:
            # met when some HPA run held at least as many GPU-seconds and every such run attained less
            costlier = [h for h in hpas if h["gpu_s"] >= mine["gpu_s"]]
            better = bool(costlier) and all(mine["attainment"] > h["attainment"] for h in costlier)
            points = "; ".join(f"{h['mode']} {100 * h['attainment']:.1f} % at {h['gpu_s']:.0f} GPU-s" for h in hpas)
            out.append(
                f"- {name} vs the HPA-shaped baseline: {100 * mine['attainment']:.1f} % at {mine['gpu_s']:.0f} "
                f"GPU-s held against {points} (higher attainment than every HPA run with as many or more "
                "GPU-seconds, and there is one): " + ("met" if better else "not met")
            )
        out.append(f"- {name}: streams cut by a scale-down: {mine['cut']} (target 0)")
        if mine["cold_within"] is not None:
            out.append(
                f"- {name}: held requests served within the learnt start-up + 10 %: {mine['cold_within']:.0%} "
                f"(longest hold {mine['cold_ratio_max']:.2f}x the learnt start-up)"
            )
    return [*out, ""]


def _extras(extras: dict[str, Any], slo: dict[str, float], time_scale: float) -> list[str]:
    if "markdown" in extras:  # carried over from an earlier report (`--extras-from` a .md file)
        return str(extras["markdown"]).splitlines()
    out: list[str] = []
    kills = extras.get("kill")
    if kills:
        out += ["## A replica killed (`kill -9`) under streaming load", "",
                "Three Llama replicas, 4 streamed requests/s (1,000 prompt tokens, 128 output) for 30 s; the "
                "replica with the most requests in flight is killed half-way.", "",
                "| stream migration | streams | cut | killed |", "| --- | ---: | ---: | --- |"]  # fmt: skip
        for k in kills:
            cut = sum(o.cut or o.status == 0 for o in k["outcomes"])
            out.append(f"| {'on' if k['migrate'] else 'off'} | {k['streams']} | {cut} | {k['killed']} |")
        out.append("")
    pds = extras.get("pd")
    if pds:
        out += ["## Convertible decoders: a prefill burst on a prefill/decode pool (4 GPUs)", "",
                "Qwen2.5-7B, code-trace prompts (32 output tokens), 3 requests/s with a 3x burst in the middle "
                "third; fixed roles 1 prefill + 3 decode against the planner with convertible decoders "
                "(bounds 1-3 per role, the same 4 devices). SLO attainment here on the client's clock (host lag "
                "included): the decode replica's own TTFT leaves out the wait at the prefill replica.", "",
                "| roles | SLO attainment | TTFT p50 / p99 s | GPU-s | prefilled on a decoder | role changes |",
                "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for p in pds:
            outcomes = p["outcomes"]
            ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
            # the client's clock: a decode replica's own TTFT leaves out the wait at the prefill replica
            rate = sum(met(o, slo["ttft_s"], slo["tpot_s"]) for o in outcomes) / max(len(outcomes), 1)
            pools = p["pools"].get("pools") or []
            events = pools[0]["events"] if pools else []
            changes = ", ".join(f"{e['role']} {e['action']}" for e in events if e["action"] in ("start", "stop"))
            out.append(
                f"| {'convertible' if p['convertible'] else 'fixed'} | {100 * rate:.1f} % | "
                f"{_fmt(percentile(ttfts, 50))} / {_fmt(percentile(ttfts, 99))} | {gpu_seconds(p['samples']):.0f} | "
                f"{p.get('local_prefills', '-')} | {changes or '-'} |"
            )
        out.append("")
    share = extras.get("share")
    if share:
        outcomes = share["outcomes"]
        switched = [o for o in outcomes if o.cold_start_ms is not None]
        others = [o.ttft_s for o in outcomes if o.cold_start_ms is None and o.ttft_s is not None]
        holds = [o.cold_start_ms / 1000 for o in switched if o.cold_start_ms is not None]
        out += ["## Two models sharing one GPU (`share: {max_awake: 1}`, sleep level 1)", "",
                "Llama-3.1-8B and Qwen2.5-7B on device 0, alternating 10 s phases of 1 request/s each for 60 s: "
                "each phase change wakes one model and puts the other to sleep once its requests drained.", "",
                f"- switches held {len(switched)} requests: hold p50 {_fmt(percentile(holds, 50))} s, max "
                f"{_fmt(max(holds) if holds else None)} s (the first switch to a model is its cold start)",
                f"- TTFT p50 of a switching request {_fmt(percentile([o.ttft_s for o in switched if o.ttft_s], 50))} s "
                f"against {_fmt(percentile(others, 50))} s for the others",
                f"- served {sum(o.served for o in outcomes)} of {len(outcomes)}", ""]  # fmt: skip
    return out


def _plot(path: Path, runs: Sequence[Run], curve: dict[str, list[tuple[float, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        times = [s.at_s for s in run.samples]
        pools = sorted({p for s in run.samples for p in s.awake})
        stacks = [[s.awake.get(p, 0) for s in run.samples] for p in pools]
        stacks += [[s.asleep.get(p, 0) for s in run.samples] for p in pools]
        labels = [f"{p} GPUs awake" for p in pools] + [f"{p} GPUs asleep" for p in pools]
        if times:
            ax.stackplot(times, *stacks, labels=labels, step="post", alpha=0.55)
        ax.set_ylabel("GPUs held")
        ax.set_ylim(0, 9)
        ax.set_title(run.mode, loc="left", fontsize=9)
        twin = ax.twinx()
        for model, points in curve.items():
            twin.plot([t for t, _ in points], [r for _, r in points], lw=1, label=f"{model} req/s")
        twin.set_ylabel("offered req/s")
        if ax is axes[0, 0]:
            ax.legend(loc="upper left", fontsize=7)
            twin.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds (one compressed day)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
