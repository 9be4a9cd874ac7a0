"""Statistics, tables and plots of a predictor benchmark run (see run.py).

.venv/bin/python -m bench.predictor.report var/bench/predictor-raw.json   # re-render only
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from policies.schema import DEFAULT_MIN_PROBABILITY
from predictor.features import probability_within

RESULTS = Path(__file__).resolve().parents[1] / "results"
TTFT_MAPE_TARGET, TPOT_MAPE_TARGET, COVERAGE_TARGET = 10.0, 5.0, (0.85, 0.95)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _reason(row: dict[str, Any]) -> str:
    message = row.get("message") or ""
    if row["code"] != "slo_unattainable":
        return row["code"] or str(row["status"])
    if message.startswith("Shed"):
        return "shed"
    if message.startswith("Waited"):
        return "queue_timeout"
    if message.startswith("The SLO queue is full"):
        return "queue_full"
    return "slo_unattainable"


def accuracy(rows: list[dict[str, Any]], time_scale: float, source: str | None = None) -> dict[str, Any]:
    """MAPE and p90 coverage of the gateway's pre-dispatch prediction against what the client saw."""
    ttft_err, ttft_cov, tpot_err, tpot_cov = [], [], [], []
    engine_err, host_lag = [], []  # vs the engine's own TTFT (if it sent timings); its gap to the client's
    pairs: list[tuple[float, float, float, float | None]] = []  # predicted/actual ttft, tpot (engine ms)
    for r in rows:
        p = r["prediction"]
        if r["status"] != 200 or r["ttft_s"] is None or not p:
            continue
        if source is not None and r["prediction_source"] != source:
            continue
        actual_ttft = r["ttft_s"] * 1000.0 - r["queued_ms"]
        if actual_ttft <= 0:
            continue
        ttft_err.append(abs(p["ttft"] - actual_ttft) / actual_ttft)
        ttft_cov.append(actual_ttft <= p["ttft_p90"])
        engine_ttft = (r.get("engine") or {}).get("ttft_s", 0.0) * 1000.0 / time_scale
        if engine_ttft > 0:
            engine_err.append(abs(p["ttft"] - engine_ttft) / engine_ttft)
            host_lag.append(abs(engine_ttft - actual_ttft) / actual_ttft)
        actual_tpot = r["tpot_s"] * 1000.0 if r["tpot_s"] else None
        if actual_tpot:
            tpot_err.append(abs(p["tpot"] - actual_tpot) / actual_tpot)
            tpot_cov.append(actual_tpot <= p["tpot_p90"])
        pairs.append(
            (
                p["ttft"] * time_scale,
                actual_ttft * time_scale,
                p["tpot"] * time_scale,
                actual_tpot * time_scale if actual_tpot else None,
            )
        )
    return {
        "n": len(ttft_err),
        "ttft_mape": 100 * sum(ttft_err) / len(ttft_err) if ttft_err else None,
        "ttft_cov": sum(ttft_cov) / len(ttft_cov) if ttft_cov else None,
        "tpot_n": len(tpot_err),
        "tpot_mape": 100 * sum(tpot_err) / len(tpot_err) if tpot_err else None,
        "tpot_cov": sum(tpot_cov) / len(tpot_cov) if tpot_cov else None,
        "engine_n": len(engine_err),
        "ttft_vs_engine_mape": 100 * sum(engine_err) / len(engine_err) if engine_err else None,
        "host_lag_mape": 100 * sum(host_lag) / len(host_lag) if host_lag else None,
        "pairs": pairs,
    }


def measured_window(rows: list[dict[str, Any]], args: dict[str, Any]) -> tuple[float, float]:
    """The send times (wall seconds) whose requests the statistics count: after the warm-up, before
    the cool-down; a run too short for both keeps its middle half."""
    ts = args["time_scale"]
    horizon = max(r["scheduled_s"] for r in rows)
    first, last = args["skip_warmup_s"] / ts, horizon - args["skip_cooldown_s"] / ts
    if last - first < 0.3 * horizon:
        first, last = 0.25 * horizon, 0.75 * horizon
    return first, last


def summarize(run: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    ts = args["time_scale"]
    rows = run["rows"]
    first, last = measured_window(rows, args)
    ramp = [r for r in rows if r["scheduled_s"] < first]
    rows = [r for r in rows if first <= r["scheduled_s"] <= last]
    window_s = (last - first) * ts or 1.0  # engine seconds of measured arrivals
    ttft_slo, tpot_slo = args["ttft_slo_ms"], args["tpot_slo_ms"]
    served = [r for r in rows if r["status"] == 200 and r["ttft_s"] is not None]

    def met(r: dict[str, Any]) -> bool:
        if r["status"] != 200 or r["ttft_s"] is None:
            return False
        tpot_ok = r["tpot_s"] is None or r["tpot_s"] * 1000 * ts <= tpot_slo
        return r["ttft_s"] * 1000 * ts <= ttft_slo and tpot_ok

    def share(subset: list[dict[str, Any]]) -> float | None:
        return sum(met(r) for r in subset) / len(subset) if subset else None

    reasons: dict[str, int] = {}
    for r in rows:
        if r["status"] != 200:
            reason = _reason(r)
            reasons[reason] = reasons.get(reason, 0) + 1
    good = [r for r in rows if met(r)]
    ttft = [r["ttft_s"] * 1000 * ts for r in served]
    tpot = [r["tpot_s"] * 1000 * ts for r in served if r["tpot_s"]]
    queued = [r["queued_ms"] * ts for r in served if r["queued_ms"]]
    return {
        "name": run["name"],
        "trace": run["trace"],
        "load": run["load"],
        "slo": run["slo"],
        "mode": run.get("mode", "on" if run["slo"] else "off"),
        "rate": run["rate_wall"] / ts,
        "offered": len(rows),
        "served": len(served),
        "reasons": reasons,
        "attainment": share(rows),
        "attainment_interactive": share([r for r in rows if not r["sheddable"]]),
        "attainment_sheddable": share([r for r in rows if r["sheddable"]]),
        "attainment_served": share(served),
        "goodput_rps": len(good) / window_s,
        "goodput_tps": sum(r["completion_tokens"] for r in good) / window_s,
        "ttft": [_pct(ttft, q) for q in (0.5, 0.9, 0.99)],
        "tpot": [_pct(tpot, q) for q in (0.5, 0.9, 0.99)],
        "queued": len(queued),
        "queued_p50": _pct(queued, 0.5),
        "late_p99_ms": (_pct([r["late_s"] for r in rows], 0.99) or 0) * 1000,
        "accuracy": accuracy(rows, ts),
        "accuracy_model": accuracy(rows, ts, "model"),
        "accuracy_ramp": accuracy(ramp, ts),
        "online": _online(run.get("predictor_after") or {}),
        "calibration": _calibration(served, met, ttft_slo / ts, tpot_slo / ts),
    }


CALIBRATION_BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _calibration(
    served: list[dict[str, Any]], met: Callable[[dict[str, Any]], bool], ttft_slo_ms: float, tpot_slo_ms: float
) -> list[tuple[int, int]]:
    """Per bin of the predicted probability of meeting both objectives (what the gate's default
    `compare: probability` reads, `probability_within`), (requests, those that met them). Served
    requests only: on an ungated run that is every request, so the bins are unbiased."""
    cells = [(0, 0)] * (len(CALIBRATION_BINS) - 1)
    for r in served:
        p = r.get("prediction")
        if not p:
            continue
        chance = probability_within(p["ttft"], p["ttft_p90"], ttft_slo_ms)
        if r["tpot_s"]:
            chance *= probability_within(p["tpot"], p["tpot_p90"], tpot_slo_ms)
        i = min(int(chance * 10), 9)
        n, k = cells[i]
        cells[i] = (n + 1, k + bool(met(r)))
    return cells


def _online(status: dict[str, Any]) -> dict[str, Any]:
    pool: dict[str, Any] = next(iter((status.get("pools") or {}).values()), {})
    targets = pool.get("targets") or {}
    out: dict[str, Any] = {"model_version": pool.get("model_version"), "trainings": pool.get("trainings")}
    for target in ("ttft", "tpot"):
        online = (targets.get(target) or {}).get("online") or {}
        out[target] = (online.get("mape_pct"), online.get("p90_coverage"), online.get("samples"))
    return out


def _f(x: float | None, digits: int = 1, pct: bool = False) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.{digits}f} %" if pct else f"{x:,.{digits}f}"


def _mark(ok: bool) -> str:
    return "**yes**" if ok else "no"


def _plots(summaries: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for s in summaries:
        if s["mode"] != "off":
            continue
        pairs = s["accuracy"]["pairs"]
        label = f"{s['trace']} {int(s['load'] * 100)} %"
        marker = "x" if s["trace"] == "mooncake" else "."
        axes[0].scatter(
            [a for _, a, _, _ in pairs], [p for p, _, _, _ in pairs], s=4, alpha=0.35, label=label, marker=marker
        )
        tp = [(p, a) for _, _, p, a in pairs if a]
        axes[1].scatter([a for _, a in tp], [p for p, _ in tp], s=4, alpha=0.35, label=label, marker=marker)
    for ax, name in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.set_xlabel(f"actual {name}, engine ms")
        ax.set_ylabel(f"predicted {name} (mean), engine ms")
        ax.set_title(f"{name}: predicted before dispatch vs observed")
        ax.legend(fontsize=8, markerscale=3)
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=110)
    written.append(path.name)
    plt.close(fig)

    azure = [s for s in summaries if s["trace"] == "azure"]
    loads = sorted({s["load"] for s in azure})
    if loads:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        width = 0.2
        for k, label in enumerate(("off", "on")):
            rows = [next((s for s in azure if s["load"] == load and s["mode"] == label), None) for load in loads]
            xs = [i + (k - 0.5) * 2 * width for i in range(len(loads))]
            axes[0].bar(
                [x - width / 2 for x in xs],
                [100 * (r["attainment"] or 0) if r else 0 for r in rows],
                width=width,
                label=f"{label}: all requests",
            )
            axes[0].bar(
                [x + width / 2 for x in xs],
                [100 * (r["attainment_interactive"] or 0) if r else 0 for r in rows],
                width=width,
                label=f"{label}: interactive tenant",
                alpha=0.6,
            )
            axes[1].bar(xs, [r["goodput_rps"] if r else 0 for r in rows], width=width * 2, label=label)
        for ax in axes:
            ax.set_xticks(range(len(loads)), [f"{int(x * 100)} % load" for x in loads])
            ax.legend(fontsize=8)
        axes[0].set_ylabel("requests meeting TTFT and TPOT SLOs, %")
        axes[0].set_title("SLO attainment: latency scorer + SLO gate off vs on")
        axes[1].set_ylabel("goodput, requests/s meeting both SLOs (engine time)")
        axes[1].set_title("goodput")
        fig.tight_layout()
        path = out.with_name(out.stem + "-slo.png")
        fig.savefig(path, dpi=110)
        written.append(path.name)
        plt.close(fig)
    return written


def write(results: dict[str, Any], out: Path) -> None:
    args = results["args"]
    ts = args["time_scale"]
    summaries = [summarize(run, args) for run in results["runs"]]
    plots = _plots(summaries, out)
    cap = results["capacity"]
    capacity = cap["rate_wall"] / ts
    lines = [
        "# Latency predictor and SLO gate",
        "",
        f"Generated by `bench/predictor/run.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({results.get('host', '')}) in {results.get('duration_s', 0) / 60:.0f} min.",
        "",
        "## Setup",
        "",
        f"- Fleet: {args['engines']} simulated Llama-3.1-8B@H100 engines (`sim`, vLLM V1 scheduling, "
        f"default limits) in one process at `--time-scale {ts:g}` (engines run {1 / ts:g}x slower than real "
        "time, so that the engines, the gateway and the client, all Python on this 2-vCPU machine, are never "
        "the bottleneck). **Every latency below is in engine time (wall x "
        f"{ts:g}) and every rate in engine-time requests per second**; the predictor is told the scale "
        f"(`predictor.prior.time_scale: {ts:g}`) and predicts wall time, converted the same way.",
        f"- Capacity: {capacity:.1f} req/s, the steady completion rate of a closed loop with "
        f"{args['engines'] * 320} Azure-conversation requests in flight (more than the engines batch) "
        + (
            "(given on the command line)."
            if cap.get("given")
            else f"(mean prompt {cap['mean_input']:.0f}, output {cap['mean_output']:.0f} tokens)."
        ),
        f"- Workload: the Azure LLM inference 2023 conversation trace (arrivals and lengths; output capped at "
        "1,000 tokens; unique prompts), the same window for every mode of a load, arrivals rescaled to the load "
        f"and replayed open loop for {args['duration_s']:g} engine seconds, streamed, `ignore_eos`. "
        f"{args['sheddable_share']:.0%} of requests (seeded) come from a sheddable tenant. Statistics leave out "
        f"the first {args['skip_warmup_s']:g} s of arrivals (the fleet fills: at 70-90 % load a request lives "
        "5-60 s and the decode batch grows for about 30 s; see the ramp-up line under Accuracy)"
        + (
            f" and the last {args['skip_cooldown_s']:g} s (those keep arriving so that the measured requests' "
            "futures stay real: when a window's arrivals stop, the requests still running decode faster than in any "
            "deployment, and their TPOT is a benchmark artefact no predictor should be scored on)"
            if args["skip_cooldown_s"]
            else "; the last arrivals stay in (they meet the fleet at its fullest: at 90 % load the trace's bursts "
            "build a queue that peaks at the end of the window)"
        )
        + f". Plus {args['mooncake_requests']} requests of whole "
        "Mooncake synthetic-trace conversations (long prompts sharing 512-token blocks: prefix-cache hits) at "
        f"{args['mooncake_load']:.0%} of capacity scaled by their work per request.",
        "- Predictor: defaults (XGBoost on the log-ratio over the analytic prior; p90 conformal, at least the "
        "point model's own conformal p90, with online adaptation; TTFT corrected by the last engine second's "
        f"first tokens){', plus ' + str(args['predictor']) if args['predictor'] else ''}; first trained online on "
        f"other windows of the trace at 50, 70 and 90 % load ({args['train_duration_s']:g} s each), saved "
        "(models and samples), and loaded by every measured gateway (which keeps training online).",
        f"- SLO: TTFT <= {args['ttft_slo_ms']:g} ms and TPOT <= {args['tpot_slo_ms']:g} ms (engine time). "
        "*Attainment* = share of all offered requests served within both (rejected and shed requests count as "
        "misses); *goodput* = such requests (and their output tokens) per second.",
        "- Modes at the same offered load: **off** = the default routing pipeline, no SLO classes (the predictor "
        "still predicts and learns); **on** = the default pipeline plus the `latency` scorer (weight "
        f"{args['latency_weight']:g}) and an SLO class for both tenants (the class's default `compare`: admitted where "
        f"the predicted probability of meeting both objectives is at least {DEFAULT_MIN_PROBABILITY:g}; "
        "`on_miss: queue` bounded by the TTFT objective, running requests' TPOT protected; the sheddable tenant is "
        "shed on a miss). A suffix names another `compare`: **on-p90** admits only where both p90s fit, **on-0.3** "
        "from a probability of 0.3. Ablations at the top load: **scorer** = the `latency` scorer alone (no SLO "
        "classes: it ranks by predicted mean latency), **gate** = the SLO classes without the scorer.",
        "",
        "## Accuracy (online: each request's prediction made before it ran)",
        "",
        "Mean absolute percentage error of the mean prediction and share of requests at or under the p90 "
        "prediction, for the endpoint that served it, against the latency the client observed (a queued "
        "request's wait is subtracted: it was predicted at dispatch). `/admin/predictor` columns: the "
        "gateway's own online scores over its last 1,000 outcomes (gateway-measured TTFT/TPOT).",
        "",
        "| run | served | TTFT MAPE | TPOT MAPE | TTFT p90 cov. | TPOT p90 cov. | admin TTFT MAPE / cov. "
        "| admin TPOT MAPE / cov. | model v |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for s in summaries:
        a, o = s["accuracy"], s["online"]
        lines.append(
            f"| {s['name']} | {a['n']} | {_f(a['ttft_mape'])} % | {_f(a['tpot_mape'])} % | "
            f"{_f(a['ttft_cov'], pct=True)} | {_f(a['tpot_cov'], pct=True)} | "
            f"{_f(o['ttft'][0])} % / {_f(o['ttft'][1], pct=True)} | {_f(o['tpot'][0])} % / "
            f"{_f(o['tpot'][1], pct=True)} | {o['model_version']} |"
        )
    pooled = _pooled(summaries)
    low, high = COVERAGE_TARGET
    covered = all(low <= (c or 0) <= high for c in (pooled["ttft_cov"], pooled["tpot_cov"]))
    lines += [
        "",
        f"Pooled over every run: TTFT MAPE {_f(pooled['ttft_mape'])} % (target <= 10 %: "
        f"{_mark((pooled['ttft_mape'] or 1e9) <= TTFT_MAPE_TARGET)}), TPOT MAPE {_f(pooled['tpot_mape'])} % "
        f"(target <= 5 %: {_mark((pooled['tpot_mape'] or 1e9) <= TPOT_MAPE_TARGET)}), p90 coverage TTFT "
        f"{_f(pooled['ttft_cov'], pct=True)} / TPOT {_f(pooled['tpot_cov'], pct=True)} (target 85-95 %: "
        f"{_mark(covered)}).",
        "",
    ]
    on_engine_clock = [s for s in summaries if s["accuracy"].get("engine_n")]
    if on_engine_clock:
        lines += [
            "On the engine's own clock (the simulated engine's per-request timings, which leave host delays out): "
            + "; ".join(
                f"{s['name']} TTFT MAPE {_f(s['accuracy']['ttft_vs_engine_mape'])} %, the engine's TTFT "
                f"vs the client's {_f(s['accuracy']['host_lag_mape'])} %"
                for s in on_engine_clock
            )
            + ". The second is what the testbed's shared CPUs add after dispatch (see `predictor-engine-clock.md`).",
            "",
        ]
    ramp = [s for s in summaries if s["mode"] == "off" and s["trace"] == "azure" and s["accuracy_ramp"]["n"]]
    if ramp:
        lines += [
            "Ramp-up (the arrivals left out above, gate off), while the batch they decode in is still growing: "
            + "; ".join(
                f"{100 * s['load']:.0f} % load TTFT MAPE {_f(s['accuracy_ramp']['ttft_mape'])} %, TPOT "
                f"{_f(s['accuracy_ramp']['tpot_mape'])} % ({s['accuracy_ramp']['n']} requests)"
                for s in ramp
            )
            + ". A request dispatched then shares its decode with the requests arriving after it, more of them "
            "than the batch it sees at dispatch: its TPOT is underpredicted.",
            "",
        ]
    if plots:
        lines += [f"![predicted vs actual]({plots[0]})", ""]
    lines += [
        "## SLO attainment and goodput, gate off vs on",
        "",
        "| load | mode | rate req/s | attainment | interactive | sheddable | of served | goodput req/s "
        "| goodput tok/s | shed | queue timeout | other 503 | queued (p50 ms) | TTFT p50 / p90 / p99 ms "
        "| TPOT p50 / p90 / p99 ms |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for s in (s for s in summaries if s["trace"] == "azure"):
        r = s["reasons"]
        other = sum(v for k, v in r.items() if k not in ("shed", "queue_timeout"))
        lines.append(
            f"| {int(s['load'] * 100)} % | {s['mode']} | {s['rate']:.1f} | "
            f"{_f(s['attainment'], pct=True)} | {_f(s['attainment_interactive'], pct=True)} | "
            f"{_f(s['attainment_sheddable'], pct=True)} | {_f(s['attainment_served'], pct=True)} | "
            f"{s['goodput_rps']:.2f} | {s['goodput_tps']:,.0f} | {r.get('shed', 0)} | {r.get('queue_timeout', 0)} | "
            f"{other} | {s['queued']} ({_f(s['queued_p50'], 0)}) | "
            f"{' / '.join(_f(x, 0) for x in s['ttft'])} | {' / '.join(_f(x, 1) for x in s['tpot'])} |"
        )
    top = max((s["load"] for s in summaries if s["trace"] == "azure"), default=None)
    if top is not None:
        off = next((s for s in summaries if s["trace"] == "azure" and s["load"] == top and s["mode"] == "off"), None)
        on = next((s for s in summaries if s["trace"] == "azure" and s["load"] == top and s["mode"] == "on"), None)
        if off and on:
            lines += [
                "",
                f"At {int(top * 100)} % load: attainment {_f(off['attainment'], pct=True)} off -> "
                f"{_f(on['attainment'], pct=True)} on (target: higher with the predictor: "
                f"{_mark((on['attainment'] or 0) > (off['attainment'] or 0))}); goodput {off['goodput_rps']:.2f} -> "
                f"{on['goodput_rps']:.2f} req/s.",
            ]
    if len(plots) > 1:
        lines += ["", f"![SLO attainment]({plots[1]})"]
    ungated = [s for s in summaries if s["trace"] == "azure" and s["mode"] == "off" and s["load"] == top]
    if ungated:
        cells = ungated[0]["calibration"]
        lines += [
            "",
            "### What the gate's probability means",
            "",
            f"Gate off at {int((top or 0) * 100)} % load (every request served, none steered): requests binned by "
            "the predicted probability of meeting both objectives, computed from the same predictions the gate "
            f"reads (`compare: probability` admits from {DEFAULT_MIN_PROBABILITY:g}), and the share that met them.",
            "",
            "| predicted | " + " | ".join(f"{lo:.1f}-{hi:.1f}" for lo, hi in pairwise(CALIBRATION_BINS)) + " |",
            "| --- |" + " ---: |" * len(cells),
            "| requests | " + " | ".join(str(n) for n, _ in cells) + " |",
            "| met | " + " | ".join(f"{k / n:.0%}" if n else "—" for n, k in cells) + " |",
        ]
    reading = Path(__file__).with_name("reading.md")
    if reading.exists():
        lines += ["", reading.read_text().rstrip(), ""]
    out.write_text("\n".join(lines))


def _pooled(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(s["accuracy"]["n"] for s in summaries)
    tn = sum(s["accuracy"]["tpot_n"] for s in summaries)

    def mean(key: str, weight: str) -> float | None:
        total = n if weight == "n" else tn
        if not total:
            return None
        return float(sum((s["accuracy"][key] or 0) * s["accuracy"][weight] for s in summaries) / total)

    return {
        "ttft_mape": mean("ttft_mape", "n"),
        "ttft_cov": mean("ttft_cov", "n"),
        "tpot_mape": mean("tpot_mape", "tpot_n"),
        "tpot_cov": mean("tpot_cov", "tpot_n"),
    }


if __name__ == "__main__":
    import json

    raw = Path(sys.argv[1] if len(sys.argv) > 1 else "var/bench/predictor-raw.json")
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS / "predictor.md"
    write(json.loads(raw.read_text()), target)
    print(f"wrote {target}")
