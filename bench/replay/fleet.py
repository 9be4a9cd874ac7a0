"""The simulated fleet: one `sim` process with N engines (prefix caching, KV events on).

Engines are shared by every router of a run; between routers their caches are emptied with
`POST /reset_prefix_cache` (vLLM's dev route; the engines publish AllBlocksCleared) once they are
idle. Prefix-cache hit rates come from the engines' own counters (`vllm:prefix_cache_hits_total`
/ `vllm:prefix_cache_queries_total`, in tokens), as deltas over one replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import free_ports, stop_process

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    ports: list[int]
    zmq_ports: list[int]
    served_model: str
    log_path: Path

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    @property
    def kv_event_endpoints(self) -> list[str]:
        return [f"tcp://127.0.0.1:{p}" for p in self.zmq_ports]

    def stop(self) -> None:
        stop_process(self.proc)


def start_fleet(workdir: Path, *, engines: int, preset: str, time_scale: float, served_model: str) -> Fleet:
    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(engines)
    zmq_ports = free_ports(engines)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq_ports[0]}",
              "topic": "kv-events"}  # fmt: skip
    argv = [
        sys.executable, "-m", "sim", "--preset", preset, "--host", "127.0.0.1", "--port", str(ports[0]),
        "--instances", str(engines), "--time-scale", str(time_scale), "--served-model-name", served_model,
        "--kv-events-config", json.dumps(events), "--log-level", "WARNING",
    ]  # fmt: skip
    log_path = workdir / "sim.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    fleet = Fleet(proc, ports, zmq_ports, served_model, log_path)
    deadline = time.monotonic() + 60
    for url in fleet.urls:
        while _get(url + "/health")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                fleet.stop()
                raise RuntimeError("simulated fleet failed to start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.1)
    return fleet


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""
    except OSError:
        return 0, ""


def metric_sums(url: str) -> dict[str, float]:
    """Every unlabelled-or-labelled sample of the engine's /metrics summed by metric name."""
    status, text = _get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def snapshot(fleet: Fleet) -> list[dict[str, float]]:
    return [metric_sums(url) for url in fleet.urls]


def cache_hit_rate(before: list[dict[str, float]], after: list[dict[str, float]]) -> float:
    """Prefix-cache hit rate over the interval, all engines together (tokens hit / tokens queried)."""
    hits = sum(a.get("vllm:prefix_cache_hits_total", 0.0) - b.get("vllm:prefix_cache_hits_total", 0.0)
               for a, b in zip(after, before, strict=True))  # fmt: skip
    queries = sum(a.get("vllm:prefix_cache_queries_total", 0.0) - b.get("vllm:prefix_cache_queries_total", 0.0)
                  for a, b in zip(after, before, strict=True))  # fmt: skip
    return hits / queries if queries > 0 else 0.0


def per_engine_requests(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[int]:
    name = "vllm:request_success_total"
    return [round(a.get(name, 0.0) - b.get(name, 0.0)) for a, b in zip(after, before, strict=True)]


def host_cpu_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot, from /proc/stat (all cores)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return (total - idle) / ticks, total / ticks


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (and its reaped children), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # after the command: state(0) ppid ... utime(11) stime(12) cutime(13) cstime(14)
    return sum(float(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def wait_idle(fleet: Fleet, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = sum(m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
                   for m in snapshot(fleet))  # fmt: skip
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines still busy ({busy:.0f} requests) after {timeout_s}s")
        time.sleep(0.2)


def reset_caches(fleet: Fleet) -> None:
    """Idle engines, empty prefix caches (AllBlocksCleared published)."""
    wait_idle(fleet)
    for url in fleet.urls:
        request = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            if response.status != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache answered {response.status}")
