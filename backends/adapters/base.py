"""The engine-adapter contract, and the reader of the Prometheus text the engines' metrics come in.

The contract
------------
The engine-adapter contract: what tokenway must know about one engine kind, and nothing else.

An adapter is a stateless, synchronous translator between tokenway's vocabulary (a `PoolConfig`, a
`ReplicaPlan`, an OpenAI request body, `EndpointStats`) and one engine's: its command line and
environment, its readiness signals, its metrics format, the request fields it rejects, its priority
scale and its prefill/decode handshake. Sockets and processes live in the supervisor and the monitor;
adapters only build and parse values, so each is tested with literal inputs.

Prometheus text
---------------
A minimal reader of the Prometheus text exposition format (0.0.4), for scraping engines.

Why not `prometheus_client.parser`: it builds every family of every histogram, and an engine's
`/metrics` is mostly histograms we never read; scraping each endpoint four times a second should cost
microseconds. This reader scans lines, keeps only the requested metric names, and parses labels only
for those.

An engine's metrics are input: a sample whose value is not a finite number of at most
`MAX_SAMPLE_VALUE` in magnitude (NaN, +Inf, 1e300) is dropped, so sums over samples stay finite and
`int()` of them never raises; what the values then mean (a negative gauge, a ratio above 1) is
bounded once, by `backends.scrape.bounded_stats`, for every adapter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from backends.config import PoolConfig
from backends.types import EndpointStats, Role

# tokenway's priority scale: an int, higher = more important. It mirrors
# policies.schema.PRIORITY_VALUES (critical 2 ... sheddable -2); backends cannot import policies, a
# test keeps the two in step. Adapters map it onto each engine's scale.
PRIORITY_MIN = -2
PRIORITY_MAX = 2

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "*"})


def connect_host(bind_host: str) -> str:
    """The address to reach a server bound to `bind_host` from this machine."""
    if bind_host in _WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """Where and with what one launched replica runs: decided by the planner, read by adapters."""

    pool: str
    role: Role
    index: int  # per role, from 0
    host: str  # bind address
    port: int
    devices: tuple[int, ...] = ()  # accelerator indices; () = not managed (engine sees the host's)
    kv_events_port: int | None = None  # ZMQ publisher port when the pool enables KV events
    kv_events_replay_port: int | None = None  # ZMQ replay (ROUTER) port, to catch up after a gap
    kv_transfer_port: int | None = None  # per-replica KV-transfer side channel (PD pools)
    log_path: str | None = None
    run_dir: str = "var/run/engines"  # where generated engine config files go
    hash_seed: str = "0"  # PYTHONHASHSEED for engines that hash prefixes in Python (vLLM)
    kv_store_url: str | None = None  # the pool's simulated KV store the supervisor runs (sim pools with kv_store)

    @property
    def endpoint_id(self) -> str:
        """Stable across restarts: "<pool>/<role>-<index>"."""
        return f"{self.pool}/{self.role.value}-{self.index}"

    @property
    def file_stem(self) -> str:
        return f"{self.pool}.{self.role.value}-{self.index}"

    @property
    def base_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One replica's process: argv, the environment variables set on top of the gateway's own, and
    files (engine config) written before launch. `secret_env` names values a plan must not print."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    log_path: str | None = None
    files: Mapping[str, str] = field(default_factory=dict)  # path -> content
    secret_env: frozenset[str] = frozenset()


class Probe(StrEnum):
    """What one `/health` answer means while the process lives."""

    STARTING = "starting"  # connection refused (still loading) or an explicit "starting" answer
    READY = "ready"
    FAILING = "failing"  # answers, but not healthy (e.g. vLLM 503 after EngineDeadError)


class EngineAdapter(Protocol):
    """One engine kind. Instances are immutable and shared; every method is a pure function."""

    @property
    def kind(self) -> str:
        """Registry key and `engine:` value in gateway.yaml."""
        ...

    @property
    def launches(self) -> bool:
        """False for remote APIs: only static endpoints."""
        ...

    @property
    def uses_devices(self) -> bool:
        """Replicas get accelerators (tensor_parallel x pipeline_parallel each)."""
        ...

    @property
    def device_env(self) -> str | None:
        """The variable that restricts the devices a replica sees."""
        ...

    @property
    def device_tool(self) -> str | None:
        """The CLI that lists this host's devices: nvidia-smi | npu-smi."""
        ...

    @property
    def supports_pd(self) -> bool: ...

    @property
    def health_path(self) -> str: ...

    @property
    def metrics_paths(self) -> tuple[str, ...]:
        """Tried in order; the first that answers is kept per endpoint. Empty = no metrics."""
        ...

    @property
    def kv_events_port_needed(self) -> bool:
        """KV events are published on a per-replica port (vLLM's ZMQ), not over the HTTP port."""
        ...

    @property
    def kv_transfer_port_needed(self) -> bool:
        """PD replicas need a per-replica KV-transfer side-channel port."""
        ...

    @property
    def discovers_model_name(self) -> bool:
        """The served model id is only known from the engine's /v1/models."""
        ...

    def validate(self, pool: PoolConfig) -> list[str]:
        """Problems with the pool for this engine (empty when it can be launched as configured)."""
        ...

    def served_model(self, pool: PoolConfig) -> str:
        """The model name this engine expects in request bodies."""
        ...

    def launch_spec(self, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
        """The exact process to start for `replica` of `pool`."""
        ...

    def kv_events_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        """Where a subscriber reads this replica's KV-cache events (None when disabled)."""
        ...

    def kv_events_replay_endpoint(self, pool: PoolConfig, replica: ReplicaPlan) -> str | None:
        """Where a subscriber asks for missed KV-cache event batches (None when there is none)."""
        ...

    def classify_health(self, status: int | None, headers: Mapping[str, str]) -> Probe:
        """Interpret one health answer; `status` None = connection refused or reset."""
        ...

    def parse_metrics(self, payload: Any, previous: EndpointStats | None = None) -> EndpointStats:
        """Parse one metrics payload (text, bytes or decoded JSON); fields the payload lacks keep
        `previous`'s values. Raises MetricsFormatError when it carries none of the load metrics."""
        ...

    def shape_request(self, body: Mapping[str, Any], api: str, pool: PoolConfig | None = None) -> dict[str, Any]:
        """A copy of `body` this engine accepts: rejected fields removed, `priority` (tokenway scale)
        mapped to the engine's, or removed when the pool's engines do not schedule by priority.
        `api` is chat | completions | embeddings. Without `pool`, priority scheduling is assumed
        (the PoolConfig default)."""
        ...

    def prefill_leg_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The request to send to the prefill endpoint of a disaggregated pool."""
        ...

    def decode_leg_body(self, body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
        """The request to send to the decode endpoint, carrying what the prefill leg returned."""
        ...


def replica_devices_needed(pool: PoolConfig) -> int:
    return pool.tensor_parallel * pool.pipeline_parallel


Sample = tuple[dict[str, str], float]

# 2^53: every integer up to it is exact as a float, and no counter an engine keeps comes near it
# (a trillion tokens a day for 24 years); a sum of what one bounded scrape holds stays finite.
MAX_SAMPLE_VALUE = float(1 << 53)

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str, wanted: Collection[str]) -> dict[str, list[Sample]]:
    """Samples of the `wanted` metric names: name -> [(labels, value)], in exposition order.

    Lines that are comments, malformed, or of other metrics are skipped; a value that is not a float,
    not finite, or larger in magnitude than `MAX_SAMPLE_VALUE` drops the sample. Timestamps after the
    value are ignored.
    """
    found: dict[str, list[Sample]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            if name not in wanted:
                continue
            close = line.rfind("}")
            if close < brace:
                continue
            labels = _parse_labels(line[brace + 1 : close])
            rest = line[close + 1 :]
        else:
            if space == -1:
                continue
            name = line[:space]
            if name not in wanted:
                continue
            labels = {}
            rest = line[space:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isfinite(value) or abs(value) > MAX_SAMPLE_VALUE:
            continue
        found.setdefault(name, []).append((labels, value))
    return found


def _parse_labels(body: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for match in _LABEL.finditer(body):
        value = match.group(2)
        if "\\" in value:
            value = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)
        labels[match.group(1)] = value
    return labels


def first_present(samples: dict[str, list[Sample]], names: Collection[str]) -> list[Sample] | None:
    """The samples of the first name in `names` that the payload has (new names before old ones)."""
    for name in names:
        if name in samples:
            return samples[name]
    return None


def total(samples: list[Sample] | None) -> float | None:
    """Sum over label sets (engines report one series per data-parallel rank)."""
    return None if samples is None else sum(v for _, v in samples)


def mean(samples: list[Sample] | None) -> float | None:
    return None if not samples else sum(v for _, v in samples) / len(samples)
