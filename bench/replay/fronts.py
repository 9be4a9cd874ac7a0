"""The routers under test, each a process in front of the same engines: tokenway variants and vllm-router.

tokenway variants differ only in gateway.yaml's `routing:` section (the baselines are its own
`routing.default.router: round-robin | least-inflight`); the pool is the fleet's engines as static
`engine: sim` endpoints (each with its `kv_events_endpoint`, used in precise mode only). llm-d's
"sticky until saturated" default runs as one more tokenway variant (`llmd_sticky_routing`, NOTES.md).
vllm-router (PyPI `vllm-router`, a Rust binary) runs from `bench/.venv-vllm-router/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.replay.fleet import Fleet
from policies.policy import hash_key
from tests.support.procs import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-replay-bench-0001"
VLLM_ROUTER_VENV = REPO / "bench" / ".venv-vllm-router"
VLLM_ROUTER_BIN = VLLM_ROUTER_VENV / "bin" / "vllm-router"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    name: str  # label in the report
    kind: str  # "tokenway" | "vllm-router"
    routing: dict[str, Any] = field(default_factory=dict)  # tokenway: the routing: section
    args: tuple[str, ...] = ()  # vllm-router: extra argv
    note: str = ""
    replicas: int = 1  # tokenway: gateway replicas behind haproxy (TCP round robin) when > 1
    state: dict[str, Any] = field(default_factory=dict)  # tokenway: the state: section (redis for sharing)


# llm-d's "sticky until saturated" (its default for prefill-bound traffic): the affinity filter's
# threshold and TTFT penalty at llm-d's defaults; its peak prefill rate calibrated on our engines the
# way llm-d's recipe does (one max_num_batched_tokens chunk over its cache-miss TTFT: NOTES.md).
LLMD_AFFINITY_THRESHOLD = 0.8
LLMD_MAX_TTFT_PENALTY_S = 18.0
LLMD_CHUNK_TOKENS = 8192  # the fleet's max_num_batched_tokens


def peak_prefill_tokens_per_s(preset: str, chunk_tokens: int = LLMD_CHUNK_TOKENS) -> float:
    """llm-d's `peakPrefillThroughput` for the simulated preset: chunk / TTFT of one uncached chunk
    on an idle engine (the simulator's own step-time model, which is what a measurement returns)."""
    from backends.perf.presets import resolve_preset
    from backends.perf.roofline import prefill_time_s

    return chunk_tokens / prefill_time_s(resolve_preset(preset, None), chunk_tokens)


def llmd_sticky_routing(seed: int, preset: str) -> dict[str, Any]:
    """`prefix-cache-affinity-filter` + `token-load-scorer` + `max-score-picker` as a tokenway
    pipeline: the `prefix-affinity` filter, then `work-cost` without its decode and per-request terms
    (= in-flight uncached prefill tokens + this request's uncached tokens), the least of them wins."""
    affinity = {
        "threshold": LLMD_AFFINITY_THRESHOLD,
        "max_ttft_penalty_s": LLMD_MAX_TTFT_PENALTY_S,
        "peak_prefill_tokens_per_s": round(peak_prefill_tokens_per_s(preset)),
    }
    return {
        "seed": seed,
        "default": {
            "filters": [{"type": "prefix-affinity", "params": affinity}, {"type": "context-length"}],
            "scorers": [{"type": "work-cost", "weight": 1.0, "params": {"decode_weight": 0.0, "request_tokens": 0.0}}],
            "picker": {"type": "max-score"},
        },
    }


def tokenway_routers(seed: int, preset: str = "llama-3.1-8b@h100") -> list[RouterSpec]:
    sticky = llmd_sticky_routing(seed, preset)
    tau = LLMD_MAX_TTFT_PENALTY_S * sticky["default"]["filters"][0]["params"]["peak_prefill_tokens_per_s"]
    return [
        RouterSpec("round-robin", "tokenway", {"default": {"router": "round-robin"}},
                   note="tokenway `routing.default.router: round-robin`"),
        RouterSpec("least-load", "tokenway", {"default": {"router": "least-inflight"}},
                   note="tokenway `routing.default.router: least-inflight` (fewest in-flight requests)"),
        RouterSpec("tokenway-approx", "tokenway", {"seed": seed},
                   note="tokenway default scoring pipeline, approximate prefix index"),
        RouterSpec("tokenway-precise", "tokenway", {"seed": seed, "prefix_index": {"mode": "precise"}},
                   note="tokenway default scoring pipeline, precise prefix index (engines' KV events)"),
        RouterSpec("llm-d-sticky", "tokenway", sticky,
                   note="llm-d's \"sticky until saturated\" default (`prefix-cache-affinity-filter` 0.8, "
                        f"release at {tau:,.0f} in-flight uncached tokens ahead = 18 s x "
                        f"{tau / LLMD_MAX_TTFT_PENALTY_S:,.0f} tok/s; `token-load-scorer`; `max-score-picker`) "
                        "re-implemented as a tokenway pipeline, approximate prefix index"),
    ]  # fmt: skip


def vllm_router_routers(kv_aware: bool) -> list[RouterSpec]:
    specs = [
        RouterSpec("vllm-router-rr", "vllm-router", args=("--policy", "round_robin"),
                   note="vllm-router `--policy round_robin`"),
        RouterSpec("vllm-router-cache", "vllm-router", args=("--policy", "cache_aware"),
                   note="vllm-router `--policy cache_aware` (defaults: cache_threshold 0.3, balance 64 / 1.5)"),
    ]  # fmt: skip
    if kv_aware:
        note = "vllm-router `--policy kv_aware` with `--kv-event-source` per engine"
        specs.append(RouterSpec("vllm-router-kv", "vllm-router", args=("--policy", "kv_aware"), note=note))
    return specs


@dataclass
class Front:
    spec: RouterSpec
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    behind: list[Front] = field(default_factory=list)  # the replicas a balancer front spreads over

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        """Every process of this front (CPU accounting): the balancer and each replica."""
        return [self.proc.pid, *(p for f in self.behind for p in f.pids)]

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=30)
        for front in self.behind:
            _save_replicas_status(front)
            front.stop()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wait(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with (
            contextlib.suppress(urllib.error.URLError, OSError),  # not listening yet
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError(f"{url} did not become ready:\n{log_path.read_text(errors='replace')[-3000:]}")


def start_tokenway(spec: RouterSpec, fleet: Fleet, workdir: Path) -> Front:
    if spec.replicas > 1:
        return start_tokenway_replicas(spec, fleet, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    policies = {
        "tenants": {"bench": {}},
        "keys": [{"id": "bench", "tenant": "bench", "sha256": hash_key(API_KEY)}],
        "models": {fleet.served_model: {}},
    }
    pool = {
        "name": "fleet", "model": fleet.served_model, "engine": "sim",
        "endpoints": [{"url": u, "kv_events_endpoint": z} for u, z in zip(fleet.urls, fleet.kv_event_endpoints,
                                                                           strict=True)],
    }  # fmt: skip
    config = {
        # no first-token deadline and no stall ejection: a request stays where the router put it (at
        # a burst or a deep queue both would move or cut requests, which no other router here does)
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "drain_timeout_s": 5,
            "stall_after_s": 600.0,
            "first_token_deadline": {"enabled": False},
        },
        "policies": "policies.yaml",
        "pools": [pool],
        "routing": spec.routing,
        "backends": {"health_interval_s": 5.0},
    }
    if spec.state:
        config["state"] = spec.state
    (workdir / "policies.yaml").write_text(yaml.safe_dump(policies, sort_keys=False))
    config_path = workdir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.app.cli", "--log-level", "WARNING", "serve", "--config", str(config_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=_env(),
        )  # fmt: skip
    front = Front(spec, proc, port, log_path)
    _wait(front.url + "/readyz", proc, log_path)
    _wait_all_ready(front, precise=spec.routing.get("prefix_index", {}).get("mode") == "precise")
    return front


def _wait_all_ready(front: Front, *, precise: bool, timeout_s: float = 30.0) -> None:
    """Every endpoint ready (not only one per pool, which is all /readyz asks) and KV subscriptions up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(front.url + "/admin/backends", timeout=2) as response:
            pools = json.loads(response.read())["pools"]
        if all(e["state"] == "ready" for p in pools for e in p["endpoints"]):
            if precise:
                time.sleep(1.5)  # the gateway ensures its KV-event subscriptions once a second
            return
        time.sleep(0.1)
    raise RuntimeError("tokenway endpoints did not all become ready")


def _save_replicas_status(front: Front) -> None:
    """Keep a replica's /admin/replicas (published, folded, dropped, gaps) beside its log."""
    with (
        contextlib.suppress(urllib.error.URLError, OSError),
        urllib.request.urlopen(front.url + "/admin/replicas", timeout=5) as response,
    ):
        front.log_path.with_name("replicas.json").write_bytes(response.read())
    with (
        contextlib.suppress(urllib.error.URLError, OSError),
        urllib.request.urlopen(front.url + "/metrics", timeout=5) as response,
    ):
        front.log_path.with_name("metrics.txt").write_bytes(response.read())


def start_tokenway_replicas(spec: RouterSpec, fleet: Fleet, workdir: Path) -> Front:
    """`spec.replicas` tokenway processes with the same config (their own state each, or one Redis
    when `spec.state` says so) behind Debian's haproxy in TCP round-robin mode."""
    from tests.support.haproxy import start_haproxy

    replicas = []
    try:
        for i in range(spec.replicas):
            state = dict(spec.state)
            if state.get("backend") == "redis":
                state["replicas"] = {**state.get("replicas", {}), "id": f"r{i}"}
                state["key_prefix"] = state.get("key_prefix", "tokenway")  # one limiter for all three
            one = dataclasses.replace(spec, replicas=1, state=state)
            replicas.append(start_tokenway(one, fleet, workdir / f"replica-{i}"))
        balancer = start_haproxy(workdir / "haproxy", [r.port for r in replicas])
    except Exception:
        for front in replicas:
            front.stop()
        raise
    return Front(spec, balancer.proc, balancer.port, balancer.log_path, behind=replicas)


def start_vllm_router(spec: RouterSpec, fleet: Fleet, workdir: Path) -> Front:
    if not VLLM_ROUTER_BIN.exists():
        raise FileNotFoundError(
            f"{VLLM_ROUTER_BIN} missing: python3 -m venv {VLLM_ROUTER_VENV} && "
            f"{VLLM_ROUTER_VENV}/bin/pip install vllm-router"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(VLLM_ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *fleet.urls,
            "--log-level", "warning", "--prometheus-port", str(free_port()), *spec.args]  # fmt: skip
    if "kv_aware" in spec.args:
        for url, endpoint in zip(fleet.urls, fleet.kv_event_endpoints, strict=True):
            argv += ["--kv-event-source", f"{url}={endpoint}"]
        argv += ["--kv-event-block-size", "16", "--kv-event-model", fleet.served_model]
    log_path = workdir / "vllm-router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    front = Front(spec, proc, port, log_path)
    _wait(front.url + "/health", proc, log_path)
    return front


STARTERS: dict[str, Callable[[RouterSpec, Fleet, Path], Front]] = {
    "tokenway": start_tokenway,
    "vllm-router": start_vllm_router,
}


def start_front(spec: RouterSpec, fleet: Fleet, workdir: Path) -> Front:
    return STARTERS[spec.kind](spec, fleet, workdir)
