"""Elastic pools, side by side: a bursty day compressed against a simulated budget of 8 GPUs.

    .venv/bin/python -m bench.autoscale [--day-s 240] [--modes static-peak,tokens,...] [--quick]
        [--seeds 7,8,9]  several days per mode, pooled in the report (static-peak on the first only)
        [--load-gbps G --init-s S --name autoscale-NAME]  another start-up, reported beside the default
        [--merge STEM1,STEM2 --name autoscale-NAME]  one report of several invocations' raw files
        [--scale-down-cooldown-s 2]  the tokens planner's scale-down cooldown (10 s by default; the
                        HPA-shaped planner has none): at one pass, one replica down per pass

Two models (Llama-3.1-8B, chat: Azure's conversation trace; Qwen2.5-7B, code: Azure's code trace,
used in working hours only) on simulated H100s (`max_num_seqs` 8, the engines at half speed, start-up
from the weights at 8 GB/s plus 1 s, all in simulated seconds) replay the same arrivals through a
fresh gateway per mode:

    static-peak     replicas for the peak (6 + 2)          static-mean   replicas for the mean (2 + 1)
    hpa, hpa-3, -2  the HPA-shaped baseline (requests running per replica vs a target: 6, 3, 2; a lower
                    target spends more GPU-seconds: the runs to compare at equal spend)
    tokens          tokenway's planner, scale-down by stopping
    tokens-warm     tokenway's planner with a warm reserve of one chat replica, awake
    tokens-sleep    tokenway's planner with a warm reserve of one chat replica asleep (level 1)
    tokens-nosurge  tokenway's planner, chat capped at its `max_replicas` of 6 (the surge's A/B)
    tokens-0.6      tokenway's planner at `target_utilization` 0.6 instead of 0.8 (any tokens-U, 0 < U <= 1):
                    more headroom for more GPU-seconds, the tokens side of the HPA's two targets, so the
                    two planners are compared at more than one spend
    tokens-scheduled  tokens, plus the operator announcing the chat burst: at day start the bench sets a
                    floor through `PUT /admin/pools/chat/floor` (start_in_s = the burst's start, for_s = its
                    length, from workload.Burst x day_s) of 6 chat replicas, the count static-peak gives
                    chat; the planner starts them a learnt start-up early. The scheduled (announced)
                    variant, not a reactive one: the other modes get no warning

tokenway's planner may take the chat pool 2 replicas past its `max_replicas` of 6 (`surge_replicas`)
on devices the code pool's planner does not want; the HPA-shaped baseline keeps its fixed maximum.

then three short experiments: `kill -9` of a replica under streaming load with and without stream
migration; a prefill/decode pool under a prefill burst with fixed roles and with convertible
decoders; two models sharing one GPU (switch time). Results: bench/results/autoscale.md and .png
(report.py). A reading of the results goes in bench/results/autoscale.notes.md (kept across re-renders).

The day is compressed 360x but a replica's start-up is not: at the default start-up (8 GB/s + 1 s,
about 7 s wall) the 19 s burst lasts under 3 start-ups, where a real day's 5x burst of ~2 h meets a 1-2
min start-up. `--load-gbps/--init-s` with `--name` runs another start-up beside the default's file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.autoscale import report
from bench.autoscale.client import Outcome, Sample, bodies, replay, sample_replicas
from bench.autoscale.workload import Arrival, Burst, ModelLoad, diurnal, offered, schedule, working_hours
from policies.policy import hash_key
from tests.support.procs import Gateway, free_port, http_get, start_gateway

RESULTS = Path(__file__).resolve().parents[1] / "results"
KEY = "sk-bench-autoscale"
CHAT, CODE = "llama-3.1-8b", "qwen2.5-7b"
TIME_SCALE = 0.5
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.060
DEVICES = list(range(8))
LOAD_GBPS, INIT_S = 8.0, 1.0  # start-up, simulated: the weights from the page cache, a short init


def engine_args(load_gbps: float = LOAD_GBPS, init_s: float = INIT_S) -> list[str]:
    """The simulated engines' flags: half speed, start-up from the weights at `load_gbps` + `init_s`."""
    startup = ["--simulate-startup", "--load-bandwidth-gbps", f"{load_gbps:g}", "--init-s", f"{init_s:g}"]
    return ["--time-scale", str(TIME_SCALE), *startup]


ENGINE_ARGS = engine_args()
INTERVAL_S, STABILIZATION_S = 2.0, 20.0
SCALE_DOWN_COOLDOWN_S = 10.0  # the tokens planner's; the HPA-shaped one has none (its stabilisation only)
WARM_RESERVE = 1
SCHEDULED_CHAT = 6  # tokens-scheduled: the burst's floor, the chat replicas of static-peak
SURGE = 2  # chat: 6 + 2 = the 8 devices, granted only where the code pool does not want them


def loads(scale: float = 1.0) -> list[ModelLoad]:
    return [
        ModelLoad(CHAT, "conv", 3.0 * scale, diurnal, Burst(0.58, 0.66, 5.0)),
        ModelLoad(CODE, "code", 1.5 * scale, working_hours),
    ]


def burst_window(scale: float, day_s: float) -> tuple[float, float] | None:
    """The chat burst's window in seconds (its ramp included)."""
    burst = loads(scale)[0].burst
    return None if burst is None else (burst.start * day_s, burst.end * day_s)


def pool(name: str, model: str, preset: str, *, args: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "name": name, "model": model, "engine": "sim", "preset": preset, "devices": "auto",
        "max_num_seqs": 8, "max_model_len": 8192, "extra_args": list(ENGINE_ARGS if args is None else args),
        "ready_timeout_s": 120, "drain_timeout_s": 30, **fields,
    }  # fmt: skip


def autoscale(
    planner: str,
    low: int,
    high: int,
    *,
    sleep: bool = False,
    priority: int = 0,
    hpa_target: float = 6,
    reserve: int | None = None,
    surge: int = 0,
    utilization: float = 0.8,
    cooldown_s: float = SCALE_DOWN_COOLDOWN_S,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "planner": planner, "min_replicas": low, "max_replicas": high, "interval_s": INTERVAL_S,
        "stabilization_s": STABILIZATION_S, "scale_down_cooldown_s": cooldown_s, "idle_s": 15, "priority": priority,
        "ttft_slo_ms": SLO_TTFT_S * 1000, "tpot_slo_ms": SLO_TPOT_S * 1000, "max_hold_s": 60,
        "hpa_target_running": hpa_target, "surge_replicas": surge, "target_utilization": utilization,
    }  # fmt: skip
    if sleep:
        config["sleep"] = {"level": 1}
    if reserve is not None:
        config["warm_reserve"] = reserve
    return config


def mode_pools(
    mode: str, args: list[str] | None = None, cooldown_s: float = SCALE_DOWN_COOLDOWN_S
) -> list[dict[str, Any]]:
    chat_preset, code_preset = "llama-3.1-8b@h100", "qwen2.5-7b@h100"
    if mode == "static-peak":
        return [
            pool("chat", CHAT, chat_preset, args=args, replicas=6),
            pool("code", CODE, code_preset, args=args, replicas=2),
        ]
    if mode == "static-mean":
        return [
            pool("chat", CHAT, chat_preset, args=args, replicas=2),
            pool("code", CODE, code_preset, args=args, replicas=1),
        ]
    planner = "hpa" if mode.startswith("hpa") else "tokens"
    target = float(mode.removeprefix("hpa-")) if mode.startswith("hpa-") else 6.0
    sleep = mode == "tokens-sleep"
    # the warm reserve: one chat replica beyond the need, asleep (tokens-sleep) or awake (tokens-warm);
    # the code pool keeps none (idle at night: its scaled-down replicas stop rather than hold a device)
    reserve = WARM_RESERVE if mode in ("tokens-sleep", "tokens-warm") else None
    surge = SURGE if planner == "tokens" and mode != "tokens-nosurge" else 0
    use = tokens_utilization(mode)
    chat_scale = autoscale(
        planner, 1, 6, sleep=sleep, priority=1, hpa_target=target, reserve=reserve, surge=surge, utilization=use,
        cooldown_s=cooldown_s,
    )  # fmt: skip
    code_scale = autoscale(
        planner, 0, 3, sleep=sleep, hpa_target=target, reserve=0 if sleep else None, utilization=use,
        cooldown_s=cooldown_s,
    )  # fmt: skip
    return [
        pool("chat", CHAT, chat_preset, args=args, replicas=1, autoscale=chat_scale),
        pool("code", CODE, code_preset, args=args, replicas=0, autoscale=code_scale),
    ]


def tokens_utilization(mode: str) -> float:
    """tokens-U: the tokens planner at target utilisation U; every other mode at the default 0.8."""
    suffix = mode.removeprefix("tokens-")
    if suffix == mode:
        return 0.8
    try:
        value = float(suffix)
    except ValueError:
        return 0.8
    if not 0 < value <= 1:
        raise ValueError(f"{mode}: target utilisation {value:g} outside (0, 1]")
    return value


def policies() -> dict[str, Any]:
    return {
        "tenants": {"bench": {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(KEY)}],
        "models": {CHAT: {"default_max_tokens": 256}, CODE: {"default_max_tokens": 256}},
    }


def ports() -> dict[str, int]:
    """Port bases of our own (the defaults are shared by every gateway on this host)."""
    names = ("port_base", "kv_events_port_base", "kv_events_replay_port_base", "kv_transfer_port_base")
    return {name: free_port() for name in names}


def gateway(workdir: Path, pools: list[dict[str, Any]], **sections: Any) -> Gateway:
    backends = {"devices": DEVICES, "log_dir": str(workdir / "logs"), "run_dir": str(workdir / "run"), **ports()}
    return start_gateway(
        workdir,
        pools=pools,
        policies=policies(),
        backends={**backends, **sections.pop("backends", {})},
        predictor={"enabled": False, "prior": {"time_scale": TIME_SCALE}},
        ledger={"enabled": False},
        ready_timeout_s=180,
        **sections,
    )


def wait_replicas(gw: Gateway, want: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        _, body = http_get(gw.url + "/admin/backends")
        ready = sum(1 for p in json.loads(body)["pools"] for e in p["endpoints"] if e["state"] == "ready")
        if ready >= want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {ready} of {want} replicas ready")
        time.sleep(0.5)


@dataclass
class ModeRun:
    mode: str
    outcomes: list[Outcome]
    samples: list[Sample]
    pools: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    seed: int = 7


def announce(gw: Gateway, burst: tuple[float, float], replicas: int = SCHEDULED_CHAT) -> dict[str, Any]:
    """tokens-scheduled: the operator's floor for the chat burst, set at day start (`burst` in seconds
    from now)."""
    start, end = burst
    body = {"min_replicas": replicas, "start_in_s": start, "for_s": end - start}
    request = urllib.request.Request(
        gw.url + "/admin/pools/chat/floor", data=json.dumps(body).encode(), method="PUT",
        headers={"content-type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        found: dict[str, Any] = json.loads(response.read())
    return found


async def run_mode(
    mode: str,
    arrivals: list[Arrival],
    day_s: float,
    workdir: Path,
    seed: int = 7,
    args: list[str] | None = None,
    burst: tuple[float, float] | None = None,
    cooldown_s: float = SCALE_DOWN_COOLDOWN_S,
) -> ModeRun:
    pools = mode_pools(mode, args, cooldown_s)
    initial = sum(p.get("replicas", 0) for p in pools)
    gw = gateway(workdir / f"{mode}-{seed}", pools)
    try:
        wait_replicas(gw, initial)
        payloads = bodies(arrivals, salt=uuid.uuid4().hex[:6])
        if mode == "tokens-scheduled" and burst is not None:
            announce(gw, burst)
        stop = asyncio.Event()
        started = time.perf_counter()
        sampler = asyncio.create_task(sample_replicas(gw.url, started, stop))
        outcomes = await replay(gw.url, KEY, arrivals, payloads, timeout_s=day_s)
        stop.set()
        samples = await sampler
        _, body = http_get(gw.url + "/admin/pools")
        return ModeRun(mode, outcomes, samples, json.loads(body), time.perf_counter() - started, seed)
    finally:
        gw.stop()


# --- kill -9 with and without migration ------------------------------------------------------------


async def run_kill(migrate: bool, workdir: Path, seconds: float = 30.0, rate: float = 4.0) -> dict[str, Any]:
    chat = pool("chat", CHAT, "llama-3.1-8b@h100", replicas=3, migrate_streams=migrate)
    chat["extra_args"] = ["--time-scale", str(TIME_SCALE)]
    gw = gateway(workdir / f"kill-{migrate}", [chat])
    try:
        wait_replicas(gw, 3)
        arrivals = [Arrival(i, i / rate, CHAT, 1000, 128) for i in range(int(seconds * rate))]
        payloads = bodies(arrivals, salt=uuid.uuid4().hex[:6])

        async def killer() -> str:
            await asyncio.sleep(seconds / 2)
            _, body = http_get(gw.url + "/admin/backends")
            endpoints = json.loads(body)["pools"][0]["endpoints"]
            victim = max(endpoints, key=lambda e: e["inflight_requests"])
            os.killpg(victim["pid"], signal.SIGKILL)
            return f"{victim['id']} ({victim['inflight_requests']} in flight)"

        kill = asyncio.create_task(killer())
        outcomes = await replay(gw.url, KEY, arrivals, payloads, timeout_s=120)
        return {"migrate": migrate, "killed": await kill, "streams": len(outcomes), "outcomes": outcomes}
    finally:
        gw.stop()


# --- convertible decoders ----------------------------------------------------------------------------


def pd_pool(convertible: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    base = pool("pd", CODE, "qwen2.5-7b@h100", roles={"prefill": 1, "decode": 3})
    base["kv_transfer"] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    base["extra_args"] = ["--time-scale", str(TIME_SCALE)]
    routing: dict[str, Any] = {"pd": {"min_uncached_tokens": 256}}
    if convertible:
        bounds = {"prefill": {"min_replicas": 1, "max_replicas": 3}, "decode": {"min_replicas": 1, "max_replicas": 3}}
        base["autoscale"] = {**autoscale("tokens", 0, 0), "roles": bounds}
        for key in ("min_replicas", "max_replicas"):
            base["autoscale"].pop(key)
        routing["pd"]["convertible"] = {"backlog_tokens": 4096}
    return base, {"pools": {"pd": routing}}


async def run_pd(convertible: bool, workdir: Path, seconds: float = 90.0) -> dict[str, Any]:
    pd, routing = pd_pool(convertible)
    gw = gateway(workdir / f"pd-{convertible}", [pd], routing=routing, backends={"devices": [0, 1, 2, 3]})
    try:
        wait_replicas(gw, 4)
        load = [ModelLoad(CODE, "code", 3.0, lambda f: 1.0, Burst(0.3, 0.7, 3.0), max_output_tokens=32)]
        arrivals = schedule(load, seconds, seed=3)
        payloads = bodies(arrivals, salt=uuid.uuid4().hex[:6])
        stop = asyncio.Event()
        started = time.perf_counter()
        sampler = asyncio.create_task(sample_replicas(gw.url, started, stop))
        outcomes = await replay(gw.url, KEY, arrivals, payloads, timeout_s=seconds, debug=True)
        stop.set()
        samples = await sampler
        _, body = http_get(gw.url + "/admin/pools")
        local = sum(o.pd == "prefill-backlog" for o in outcomes)
        return {
            "convertible": convertible,
            "outcomes": outcomes,
            "samples": samples,
            "pools": json.loads(body),
            "local_prefills": local,
        }
    finally:
        gw.stop()


# --- two models on one GPU -------------------------------------------------------------------------------


async def run_share(workdir: Path, seconds: float = 60.0) -> dict[str, Any]:
    share = {"max_awake": 1, "min_awake_s": 1.0}
    sleepy = autoscale("tokens", 0, 1, sleep=True)
    chat = pool("chat", CHAT, "llama-3.1-8b@h100", replicas=1, devices=[0], share=share, autoscale=sleepy)
    code = pool("code", CODE, "qwen2.5-7b@h100", replicas=0, devices=[0], share=share, autoscale=dict(sleepy))
    gw = gateway(workdir / "share", [chat, code], backends={"devices": [0]})
    try:
        wait_replicas(gw, 1)
        # alternating 10 s phases of each model, 1 request/s
        arrivals = [Arrival(i, float(i), CHAT if (i // 10) % 2 == 0 else CODE, 800, 32) for i in range(int(seconds))]
        payloads = bodies(arrivals, salt=uuid.uuid4().hex[:6])
        outcomes = await replay(gw.url, KEY, arrivals, payloads, timeout_s=120)
        _, body = http_get(gw.url + "/admin/pools")
        return {"outcomes": outcomes, "pools": json.loads(body)}
    finally:
        gw.stop()


# --- main ----------------------------------------------------------------------------------------------------


MODES = (
    "static-peak", "static-mean", "hpa", "hpa-3", "hpa-2", "tokens", "tokens-warm", "tokens-sleep", "tokens-nosurge",
    "tokens-scheduled", "tokens-0.6",
)  # fmt: skip


def day_plan(modes: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(mode, seed) in run order: seed by seed, each seed's modes side by side; static-peak (its GPU-s
    are the same every day, its attainment ~100 %) on the first seed only."""
    return [(m, s) for i, s in enumerate(seeds) for m in modes if not (m == "static-peak" and i > 0)]


async def main_async(args: argparse.Namespace) -> None:
    day_s = args.day_s
    seeds = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [args.seed]
    days = {seed: schedule(loads(args.scale), day_s, seed=seed) for seed in seeds}
    modes = [m for m in (args.modes.split(",") if args.modes else MODES) if m]
    flags = engine_args(args.load_gbps, args.init_s)
    began = time.time()
    load_before = os.getloadavg()[0]
    runs: list[ModeRun] = []
    with tempfile.TemporaryDirectory(prefix="tw-autoscale-") as tmp:
        workdir = Path(tmp)
        for mode, seed in day_plan(modes, seeds):
            arrivals = days[seed]
            print(f"[autoscale] {mode} (seed {seed}): {len(arrivals)} requests over {day_s:g} s", flush=True)
            burst = burst_window(args.scale, day_s)
            runs.append(await run_mode(mode, arrivals, day_s, workdir, seed, flags, burst, args.scale_down_cooldown_s))
        extras: dict[str, Any] = {}
        extras_generated = None
        if args.skip_extras and args.extras_from is not None:
            extras, extras_generated = old_extras(args.extras_from)
        if not args.skip_extras:
            print("[autoscale] kill -9 under load, with and without migration", flush=True)
            extras["kill"] = [await run_kill(True, workdir), await run_kill(False, workdir)]
            print("[autoscale] prefill/decode: fixed roles, convertible decoders", flush=True)
            extras["pd"] = [await run_pd(False, workdir), await run_pd(True, workdir)]
            print("[autoscale] two models on one GPU", flush=True)
            extras["share"] = await run_share(workdir)
    meta = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
        "minutes": round((time.time() - began) / 60, 1),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "day_s": day_s,
        "requests": {seed: len(arrivals) for seed, arrivals in days.items()},
        "seeds": seeds,
        "devices": len(DEVICES),
        "command": "python -m bench.autoscale " + " ".join(args.argv),
        "title": args.title,
        "variant": args.variant,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "time_scale": TIME_SCALE,
        "interval_s": INTERVAL_S,
        "stabilization_s": STABILIZATION_S,
        "scale_down_cooldown_s": args.scale_down_cooldown_s,
        "burst_s": burst_window(args.scale, day_s),
        "load_gbps": args.load_gbps,
        "init_s": args.init_s,
        "extras_generated": extras_generated,
        "warm_reserve": WARM_RESERVE,
        "surge": SURGE,
    }
    curve = offered(loads(args.scale), day_s, 1.0)
    raw = RESULTS / f"{args.name}-raw.json"
    raw.write_text(
        json.dumps(
            {
                "meta": meta,
                "runs": [
                    {
                        "mode": r.mode,
                        "seed": r.seed,
                        "outcomes": [o.row() for o in r.outcomes],
                        "samples": [asdict(s) for s in r.samples],
                        "pools": r.pools,
                    }
                    for r in runs
                ],
                "extras": _plain(extras),
            },
            default=str,
        )
    )
    report.write(RESULTS, meta, runs, curve, extras, args.name)
    print(f"[autoscale] wrote {RESULTS / (args.name + '.md')}", flush=True)


def _plain(value: Any) -> Any:
    """The extras for the raw file: outcomes and samples as their rows."""
    if isinstance(value, Outcome):
        return value.row()
    if isinstance(value, Sample):
        return asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _outcome(row: dict[str, Any]) -> Outcome:
    return Outcome(**{k: v for k, v in row.items() if k != "tpot_s"})


def _revive(value: Any) -> Any:
    """Outcomes and samples back from the raw file's plain rows."""
    if isinstance(value, dict):
        if "prompt_tokens" in value and "sent_s" in value:
            return _outcome(value)
        if {"at_s", "awake", "ready", "desired"} <= set(value) <= {*Sample.__dataclass_fields__}:
            return Sample(**value)
        return {k: _revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_revive(v) for v in value]
    return value


EXTRAS_HEADING = "## A replica killed"
EXTRAS_FROM_LINE = "are those of the run of "


def old_extras(raw_path: Path) -> tuple[dict[str, Any], str]:
    """The three short experiments of an earlier run (`--extras-from`), and when it ran: from its raw
    file, or from its report (a .md: the raw files are not kept in git) as the markdown it wrote."""
    if raw_path.suffix == ".md":
        text = raw_path.read_text()
        section = text[text.index(EXTRAS_HEADING) :].split("\n![", 1)[0].rstrip()
        if EXTRAS_FROM_LINE in text:  # that report carried them over from a run before it
            generated = text.split(EXTRAS_FROM_LINE, 1)[1].split(" (", 1)[0]
        else:  # its own: "Generated by `...` on 2026-12-02 20:29 UTC (22.3 min, ..."
            generated = text.split("` on ", 1)[1].split(" (", 1)[0] if "` on " in text else "?"
        return {"markdown": section + "\n"}, generated
    raw = json.loads(raw_path.read_text())
    return _revive(raw.get("extras") or {}), raw["meta"]["generated"]


def merge_raw(raws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several invocations' raw files as one (`--merge`): days run apart (another seed, a mode added
    later) reported side by side and pooled per mode. Every part must share the day's settings
    (length, start-up, SLO, time scale), else their rows would not compare."""
    first = raws[0]["meta"]
    same = ("day_s", "load_gbps", "init_s", "slo", "time_scale", "interval_s", "stabilization_s")
    for raw in raws[1:]:
        differs = [key for key in same if raw["meta"].get(key) != first.get(key)]
        if differs:
            raise ValueError(f"raw files differ in {', '.join(differs)}: not one experiment")
    metas = [raw["meta"] for raw in raws]
    seeds = sorted({int(seed) for m in metas for seed in m.get("seeds") or [m.get("seed", 7)]})
    requests = {str(k): v for m in metas for k, v in (m.get("requests") or {}).items()}
    meta = {
        **first,
        "seeds": seeds,
        "requests": requests,
        "minutes": round(sum(m.get("minutes", 0) for m in metas), 1),
        "load": [metas[0]["load"][0], metas[-1]["load"][-1]],
        "generated": " to ".join(dict.fromkeys((metas[0]["generated"], metas[-1]["generated"]))),
        "command": " ; ".join(m.get("command", "") for m in metas),
    }
    runs = [run for raw in raws for run in raw["runs"]]
    extras: dict[str, Any] = next((raw["extras"] for raw in raws if raw.get("extras")), {})
    return {"meta": meta, "runs": runs, "extras": extras}


def rebuild(raw_path: Path, name: str = "autoscale") -> None:
    """The report again from a raw file (after a change to report.py or to the notes; nothing is re-run)."""
    raw = json.loads(raw_path.read_text())
    meta = raw["meta"]
    meta.setdefault("burst_s", burst_window(1.0, meta["day_s"]))
    runs = [
        ModeRun(
            r["mode"],
            [_outcome(o) for o in r["outcomes"]],
            [Sample(**x) for x in r["samples"]],
            r["pools"],
            seed=r.get("seed", meta.get("seed", 7)),
        )
        for r in raw["runs"]
    ]
    curve = offered(loads(), meta["day_s"], 1.0)
    report.write(RESULTS, meta, runs, curve, _revive(raw.get("extras") or {}), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--day-s", type=float, default=240.0, help="wall seconds the day is compressed into")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every model's arrival rate")
    parser.add_argument("--modes", default="", help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--seeds", default="", help="comma-separated seeds: one day each per mode (static-peak on the first only)"
    )
    parser.add_argument(
        "--load-gbps", type=float, default=LOAD_GBPS, help="simulated start-up: weights read at this GB/s"
    )
    parser.add_argument("--init-s", type=float, default=INIT_S, help="simulated start-up: initialisation s")
    parser.add_argument(
        "--name",
        default="autoscale",
        help="results' file stem: a variant (other start-up, other days) goes beside autoscale.md, never over it",
    )
    parser.add_argument(
        "--scale-down-cooldown-s",
        type=float,
        default=SCALE_DOWN_COOLDOWN_S,
        help="the tokens planner's least time after a scale event before a scale-down (one replica each)",
    )
    parser.add_argument("--title", default="", help="appended to the report's heading")
    parser.add_argument("--variant", default="", help="a paragraph the report prints under its introduction")
    parser.add_argument("--skip-extras", action="store_true", help="only the side-by-side day")
    parser.add_argument(
        "--extras-from",
        type=Path,
        default=None,
        help="with --skip-extras: report the short experiments of this raw file (or of this autoscale.md)",
    )
    parser.add_argument("--quick", action="store_true", help="a 60 s day, tokens and static-peak only")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw file")
    parser.add_argument(
        "--merge",
        default="",
        help="comma-separated results stems (their -raw.json): one report of them all under --name, nothing run",
    )
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.merge:
        parts = [json.loads((RESULTS / f"{stem}-raw.json").read_text()) for stem in args.merge.split(",") if stem]
        merged = merge_raw(parts)
        if args.title:
            merged["meta"]["title"] = args.title
        if args.variant:
            merged["meta"]["variant"] = args.variant
        (RESULTS / f"{args.name}-raw.json").write_text(json.dumps(merged, default=str))
        rebuild(RESULTS / f"{args.name}-raw.json", args.name)
        return
    if args.report_only:
        rebuild(RESULTS / f"{args.name}-raw.json", args.name)
        return
    if args.quick:
        args.day_s, args.modes, args.skip_extras = 60.0, args.modes or "static-peak,tokens", True
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
