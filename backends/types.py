"""The room's vocabulary: endpoints, their state, role, load and stats, where each sits (topology), and
the room's exceptions.

Topology
--------
Where an endpoint sits: node, rack (an NVLink domain or a top-of-rack switch), zone; and the link
class between two endpoints.

A KV transfer between a prefill and a decode replica crosses the fastest link the two share: the
node's NVLink / PCIe fabric when both are on one node, the rack's switch when both are in one rack,
the spine between racks, the provider's network between zones. Routing prices that transfer
(`policies/routing/pd.py`); this module only says which class of link it is.

Labels come from config (`topology:` of a static endpoint, or of a pool for its launched replicas)
or from Kubernetes (the EndpointSlice's `nodeName` and `zone`, and a rack label of the node).
A missing label is unknown, never "the same": an endpoint without any label has no link class
to anything, and routing then charges no transfer (topology-blind, as before labels existed).

Endpoints
---------
Vocabulary of the backends room: endpoint states, roles, scraped stats, in-flight load.

These types are the lowest shared layer: policies (routing, admission) and the predictor read them,
only backends' background tasks and the gateway's dispatch accounting write them.

The room's exception tree lives here too:

    BackendsError                 any failure raised by backends code
    ├── PlanError                 pools cannot be planned: devices, ports, an adapter's constraints;
    │                             the message names the pool (a configuration error, never a retry)
    ├── MetricsFormatError        an engine's metrics payload is not what its adapter expects
    └── PdError                   prefill/decode disaggregation cannot proceed
        ├── PdUnsupportedError    the engine kind has no PD handshake (remote APIs)
        └── PdHandshakeError      the prefill leg's response lacks what the decode leg needs

Runtime failures of launched replicas (crash loops, startup timeouts) are not exceptions: they are
endpoint states with a reason and a log tail, so one failing pool never stops the others.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal

SAME_NODE: Final = "same_node"
SAME_RACK: Final = "same_rack"
CROSS_RACK: Final = "cross_rack"
CROSS_ZONE: Final = "cross_zone"
LINK_CLASSES: Final = (SAME_NODE, SAME_RACK, CROSS_RACK, CROSS_ZONE)  # fastest first

LinkClass = Literal["same_node", "same_rack", "cross_rack", "cross_zone"]


@dataclass(frozen=True, slots=True)
class Topology:
    """An endpoint's topology labels; None: not known."""

    node: str | None = None
    rack: str | None = None
    zone: str | None = None

    @property
    def known(self) -> bool:
        return self.node is not None or self.rack is not None or self.zone is not None


UNKNOWN: Final = Topology()


def link_class(a: Topology, b: Topology) -> LinkClass | None:
    """The class of the fastest link between two endpoints; None when either has no labels.

    Same node beats same rack; two endpoints whose zones differ are cross-zone whatever else they
    say; otherwise different (or unknown) nodes outside a shared rack are cross-rack, the
    conservative reading of "not shown to share a rack"."""
    if not a.known or not b.known:
        return None
    if a.node is not None and a.node == b.node:
        return SAME_NODE
    if a.zone is not None and b.zone is not None and a.zone != b.zone:
        return CROSS_ZONE
    if a.rack is not None and a.rack == b.rack:
        return SAME_RACK
    return CROSS_RACK


class EndpointState(StrEnum):
    """Lifecycle of one endpoint as routing sees it. Only READY endpoints take new requests."""

    STARTING = "starting"  # launched, not answering /health yet (connection refused while loading)
    READY = "ready"
    DRAINING = "draining"  # finishing in-flight requests before a stop; takes no new ones
    UNHEALTHY = "unhealthy"  # ejected by passive/active checks; a half-open probe may bring it back
    DEAD = "dead"  # process exited (launched endpoints) or crash-looping
    SLEEPING = "sleeping"  # launched, asleep (vLLM sleep mode): weights off the device, wakes in seconds
    STOPPED = "stopped"  # an autoscaled slot with no process: scaled down, or never started


class Role(StrEnum):
    """What an endpoint does in a disaggregated (PD) pool; BOTH for ordinary pools."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class EndpointStats:
    """Engine-reported load, parsed from its metrics by the adapter of its engine kind.

    Counters (`prefix_cache_*`, `preemptions`) are cumulative as the engine reports them; consumers
    take deltas. `scraped_at_s` is `time.monotonic()` of the scrape; 0 means never scraped.
    """

    running: int = 0
    waiting: int = 0
    kv_usage_ratio: float = 0.0  # 0..1, 1 - free/total blocks
    prefix_cache_hits_tokens: float = 0.0
    prefix_cache_queries_tokens: float = 0.0
    preemptions: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # vLLM >= 0.32: waiting requests per reason ("capacity", "deferred"); empty when not reported
    waiting_by_reason: Mapping[str, int] = field(default_factory=dict)
    prompt_tokens: float = 0.0  # counter: prompt tokens the engine processed
    prompt_tokens_cached: float = 0.0  # counter: of those, served from the prefix cache
    # "awake" | "weights_offloaded" | "discard_all" | "asleep"; None when the engine does not say
    sleep_state: str | None = None
    # LoRA (vLLM's vllm:lora_requests_info): adapters of running and waiting requests, the slot count;
    # max_loras 0 when the engine serves none (docs/adapters.md)
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int = 0
    # counter: bytes the engine's KV offloading moved per direction (`gpu_to_cpu`, `cpu_to_gpu`;
    # vLLM's vllm:kv_offload_total_bytes); empty when it offloads nothing
    kv_offload_bytes: Mapping[str, float] = field(default_factory=dict)
    scraped_at_s: float = 0.0

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


@dataclass(slots=True)
class InFlight:
    """Gateway-side load on one endpoint, exact and instant (updated at dispatch, first token, end).

    `prefill_tokens` are uncached prompt tokens not yet prefilled (released at the first token);
    `decode_tokens` are the context tokens of requests in decode (prompt + expected output), a proxy
    for KV occupancy. Use `begin`/`first_token`/`end` through a `LoadTicket` so releases are exact.

    With several gateway replicas sharing state (gateway/replicas), the three totals also hold what
    the other replicas report having on the endpoint (`remote_*`, replaced as their reports come and
    go): routing reads one number either way; `local_requests` is this process's own share.
    """

    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_token_s: float = 0.0  # monotonic time a token from this endpoint was last relayed (0 = never)
    remote_requests: int = 0
    remote_prefill_tokens: int = 0
    remote_decode_tokens: int = 0
    # scrapes applied so far, and the gateway's requests that ended since the last one though they
    # began before it: the scraped running/waiting still counts them (`engine_held`)
    scrapes: int = 0
    ended_since_scrape: int = 0

    @property
    def local_requests(self) -> int:
        return self.requests - self.remote_requests

    def local(self) -> tuple[int, int, int]:
        """(requests, prefill tokens, decode tokens) of this process alone."""
        return (
            self.requests - self.remote_requests,
            self.prefill_tokens - self.remote_prefill_tokens,
            self.decode_tokens - self.remote_decode_tokens,
        )

    def set_remote(self, requests: int, prefill_tokens: int, decode_tokens: int) -> None:
        """Replace the other replicas' share of the totals."""
        self.requests += requests - self.remote_requests
        self.prefill_tokens += prefill_tokens - self.remote_prefill_tokens
        self.decode_tokens += decode_tokens - self.remote_decode_tokens
        self.remote_requests, self.remote_prefill_tokens, self.remote_decode_tokens = (
            requests,
            prefill_tokens,
            decode_tokens,
        )

    def begin(self, prefill_tokens: int) -> LoadTicket:
        self.requests += 1
        self.prefill_tokens += prefill_tokens
        return LoadTicket(self, prefill_tokens, scrape=self.scrapes)

    def scraped(self) -> None:
        """Fresh engine metrics were applied: they no longer count the requests that ended before."""
        self.scrapes += 1
        self.ended_since_scrape = 0


@dataclass(slots=True)
class LoadTicket:
    """One request's contribution to an endpoint's `InFlight`; every method is idempotent."""

    inflight: InFlight
    prefill_tokens: int
    decode_tokens: int = 0
    prefilled: bool = False
    ended: bool = False
    scrape: int = 0  # the endpoint's scrape count when it began

    def first_token(self, decode_tokens: int) -> None:
        if self.prefilled or self.ended:
            return
        self.prefilled = True
        self.inflight.prefill_tokens -= self.prefill_tokens
        self.decode_tokens = decode_tokens
        self.inflight.decode_tokens += decode_tokens

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if not self.prefilled:
            self.inflight.prefill_tokens -= self.prefill_tokens
        self.inflight.decode_tokens -= self.decode_tokens
        self.inflight.requests -= 1
        if self.scrape != self.inflight.scrapes:  # the last scrape saw it running or waiting
            self.inflight.ended_since_scrape += 1


@dataclass(slots=True, eq=False)
class Endpoint:
    """One engine replica or remote API that requests can be sent to.

    Mutable and long-lived: the fleet's background tasks update `state` and `stats`, the gateway
    updates `inflight` and the passive-health fields. Decisions read it synchronously (no await
    between reading and deciding), so they see a consistent view.
    """

    id: str  # unique, stable across restarts of the same replica: "<pool>/<role>-<index>"
    pool: str
    base_url: str  # "http://127.0.0.1:8001" (no trailing slash, no /v1)
    engine: str  # adapter kind: sim | vllm | trtllm | vllm-ascend | openai
    served_model: str  # the model name the engine expects in request bodies
    role: Role = Role.BOTH
    state: EndpointState = EndpointState.STARTING
    api_key: str | None = None
    max_model_len: int | None = None
    kv_events_endpoint: str | None = None  # "tcp://127.0.0.1:5557" when the engine publishes KV events
    kv_events_replay_endpoint: str | None = None  # "tcp://127.0.0.1:5657": ask here for missed batches
    stats: EndpointStats = field(default_factory=EndpointStats)
    inflight: InFlight = field(default_factory=InFlight)
    consecutive_failures: int = 0
    answered_at_s: float = 0.0  # monotonic time of the last upstream answer that was not a failure
    ejected_until_s: float = 0.0
    restarts: int = 0
    launched: bool = False  # True when the supervisor owns the process
    ejections: int = 0  # consecutive ejections without recovery (the cooldown doubles with each)
    state_reason: str = ""  # why the state is what it is ("crash loop: ...", "ejected: 3 failures")
    log_tail: tuple[str, ...] = ()  # last lines of the engine's log when it failed to start or crashed
    log_path: str | None = None  # launched replicas: the engine's output
    devices: tuple[int, ...] = ()  # launched replicas: accelerators given to the process
    pid: int | None = None  # launched replicas: the engine's process (group leader) while it runs
    # LoRA adapters the engine lists in /v1/models (backends/scrape.py); None: never asked.
    # `loras_at_s`: monotonic time the answering request was sent (older registrations may be gone)
    loras: frozenset[str] | None = None
    loras_at_s: float = 0.0
    # node / rack / zone (backends/types.py): prices a PD pair's KV transfer; UNKNOWN: no labels
    topology: Topology = UNKNOWN

    @property
    def ready(self) -> bool:
        return self.state is EndpointState.READY

    def stats_age_s(self, now_s: float) -> float:
        return now_s - self.stats.scraped_at_s if self.stats.scraped_at_s else float("inf")

    def engine_held(self) -> int:
        """The engine's running + waiting requests as last scraped, less the gateway's requests that
        ended since (an ended request's slot is free at once, not a scrape later)."""
        return max(self.stats.running + self.stats.waiting - self.inflight.ended_since_scrape, 0)

    def engine_waiting(self) -> int:
        """The engine's waiting requests as last scraped, less one per gateway request ended since
        (each lets a waiting one start)."""
        return max(self.stats.waiting - self.inflight.ended_since_scrape, 0)


class BackendsError(Exception):
    """Base of every error raised by the backends room."""


class PlanError(BackendsError, ValueError):
    """The pools as configured cannot be launched; the message says which pool and why."""


class MetricsFormatError(BackendsError, ValueError):
    """A metrics payload lacks the load metrics its engine kind always reports."""


class PdError(BackendsError):
    """Prefill/decode disaggregation cannot proceed for this request."""


class PdUnsupportedError(PdError):
    """The engine kind has no prefill/decode handshake."""


class PdHandshakeError(PdError):
    """The prefill leg's response lacks the parameters the decode leg needs."""


# errnos of a connection the gateway could not open for want of its own resources (descriptors, socket
# buffers, memory): they say nothing of the engine it was for, so no engine is blamed for them
GATEWAY_EXHAUSTED: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

MAX_EVENT_BYTES: Final = 16 << 20  # one server-sent event of an engine's stream; none writes more


class EventTooLarge(ValueError):
    """An event of an upstream's stream passed `MAX_EVENT_BYTES` without its end."""


class EventBuffer:
    """The event blocks of a server-sent event stream split anywhere (an upstream's answer is input):
    each whole block once, without its blank-line separator.

    Linear in the bytes fed: a chunk without a separator is kept aside, not joined and scanned again
    with every later chunk (an engine sending one endless event would otherwise cost the event loop
    quadratic time), and bounded: a block past `max_bytes` without its end raises `EventTooLarge`.
    `crlf`: lines may end in CR LF (providers' streams), read as LF, a pair split across chunks too."""

    __slots__ = ("_cr", "_parts", "_size", "crlf", "max_bytes")

    def __init__(self, max_bytes: int = MAX_EVENT_BYTES, *, crlf: bool = False) -> None:
        self.max_bytes = max_bytes
        self.crlf = crlf
        self._parts: list[bytes] = []
        self._size = 0
        self._cr = False  # a CR at the end of the last chunk, held until the next says what it ends

    def feed(self, data: bytes) -> list[bytes]:
        if self.crlf:
            if self._cr:
                data = b"\r" + data
            self._cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n")[: -1 if self._cr else None]
        last = self._parts[-1][-1:] if self._parts else b""
        if b"\n\n" not in data and not (last == b"\n" and data[:1] == b"\n"):
            if data:
                self._parts.append(data)
                self._size += len(data)
                self._check()
            return []
        *events, rest = (b"".join(self._parts) + data if self._parts else data).split(b"\n\n")
        self._parts, self._size = ([rest], len(rest)) if rest else ([], 0)
        self._check()
        return events

    def rest(self) -> bytes:
        """What is left at the stream's end: a last event without its blank line, or nothing."""
        rest, self._parts, self._size = b"".join(self._parts), [], 0
        return rest

    def clear(self) -> None:
        self._parts, self._size, self._cr = [], 0, False

    def _check(self) -> None:
        if self._size > self.max_bytes:
            self.clear()
            raise EventTooLarge(f"an event past {self.max_bytes} bytes without its end")


def usage_count(value: object) -> int:
    """One count of an upstream's `usage` (tokens) as billing reads it: a non-negative integer.
    Anything else (a negative count, a string that is not digits, a float that is not finite, null)
    reads as 0, so an upstream's bad usage can neither refund a budget (a negative cost) nor fail
    the settlement (an exception). Every reader of an engine's or a provider's usage goes through it."""
    if type(value) is int:
        return value if value > 0 else 0
    if type(value) is float and 0 < value < 1e18:
        return int(value)
    if type(value) is str and 0 < len(value) <= 18 and value.isascii() and value.isdigit():
        return int(value)
    return 0


def answer_choices(answer: object) -> list[dict[str, Any]]:
    """The choices of a parsed chat or completions answer (or stream chunk) that are objects; [] for
    anything else. An engine's answer is input too: every reader of its choices goes through this,
    so a `null`, a list or a string where an object belongs is no choice rather than an exception."""
    return objects(answer.get("choices")) if type(answer) is dict else []


def objects(value: object) -> list[dict[str, Any]]:
    """The objects in a list an upstream sent (a delta's `tool_calls`, say); [] when it is no list."""
    return [item for item in value if type(item) is dict] if type(value) is list else []


def object_field(node: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`node[key]` when it is an object (a choice's `delta` or `message`, an answer's `usage`), else {}."""
    value = node.get(key)
    return value if type(value) is dict else {}


def call_index(call: Mapping[str, Any]) -> int:
    """A streamed tool call's `index` (which call a delta continues): 0 when it is not an integer."""
    index = call.get("index")
    return index if type(index) is int and index >= 0 else 0
