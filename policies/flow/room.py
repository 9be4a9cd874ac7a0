"""A waiting room's bounds and what they tell: how long a request may wait in its band, who is shed when
the room is full, when to come back, and what a request that leaves undispatched is told.

policies.yaml's `flow_control` section sets the waits per band (hot-reloaded); gateway.yaml sets the
room's size (`saturation.py`, `FlowSettings`). Shedding and retry-after are pure functions of what
waits; the rejections are the error catalogue's queue rows.

policies.yaml's flow_control section
------------------------------------

policies.yaml's `flow_control` section: per band, how long a request may wait and what it gets then.

```yaml
flow_control:
  fairness: vtc                    # inside a band: virtual token counters (vtc) or arrival order
  shortest_job_first: false        # inside one tenant: least predicted cost first (else arrival order)
  bands:
    normal:    {max_queue_ms: 10000, on_timeout: 429}
    sheddable: {max_queue_ms: 2000,  on_timeout: fallback}
```

`on_timeout`: `429` (`rate_limit_exceeded`, type `requests`), `503` (`server_error` /
`queue_timeout`), both with retry-after from the queue's drain rate, or `fallback` (the model's chain
with trigger `queue_timeout`; 503 when no step takes it). Bands left out keep their defaults.
Tenant weights are `tenants.<name>.weight` (default 1).

Shedding and retry-after
------------------------

Bounds of a pool's waiting room: who is shed when it is full, and when to come back.

Shedding: a pool holds at most `max_queued` requests and `max_queued_bytes` of their bodies. A
newcomer that does not fit displaces requests of a strictly lower band, the lowest band first; inside
that band the tenant that has received the most service (largest virtual counter) loses its newest
request first (it has waited least). A newcomer that would have to displace its own band or a higher
one is turned away itself.

Retry-after: the requests ahead of a caller divided by the rate at which the room has recently been
dispatching (an exponentially decayed count of dispatches), in whole seconds within [1, 60] (older
openai SDKs ignore longer waits).

What a request that leaves undispatched is told
-----------------------------------------------

What a request that leaves a waiting room undispatched is told (the error catalogue's queue rows).

- waited its band's `max_queue_ms`: 429 `rate_limit_exceeded` (type `requests`) or 503 `server_error`
  / `queue_timeout`, as the band's `on_timeout` says (`fallback` answers 503 when no chain step
  takes the trigger `queue_timeout`);
- no room even after shedding lower bands: 503 `queue_full`;
- displaced by a higher band: 503 `queue_shed`.

Each carries `retry-after` / `retry-after-ms` from the room's drain rate; `reason` is what the usage
record and the metrics count (load-shedding reasons).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.types import Rejection

OnTimeout = Literal[429, 503, "fallback"]

# critical waits longest: it is what the capacity is for; sheddable traffic is dropped soonest
DEFAULT_BAND_QUEUE_MS: dict[str, float] = {
    "critical": 30_000.0,
    "high": 15_000.0,
    "normal": 10_000.0,
    "low": 5_000.0,
    "sheddable": 2_000.0,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BandPolicy(_Strict):
    max_queue_ms: float = Field(gt=0, description="longest wait in the gateway before on_timeout applies")
    on_timeout: OnTimeout = Field(default=503, description="429, 503 (with retry-after) or fallback")

    @model_validator(mode="before")
    @classmethod
    def _status_as_text(cls, value: object) -> object:
        """`on_timeout: "429"` (quoted) means the same as `on_timeout: 429`."""
        if isinstance(value, dict) and value.get("on_timeout") in ("429", "503"):
            return {**value, "on_timeout": int(value["on_timeout"])}
        return value


class ProgramFairness(_Strict):
    """`tenants.<name>.program_fairness`: inside the tenant's share, its programs go by least attained
    service (policies/flow/order.py)."""

    half_life_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="a program's attained service (tokens served) halves every this many seconds",
    )


def _default_bands() -> dict[str, BandPolicy]:
    return {name: BandPolicy(max_queue_ms=ms) for name, ms in DEFAULT_BAND_QUEUE_MS.items()}


# built once: `FlowPolicy.band` runs per request, and the models are frozen, so one set serves all
_DEFAULT_BANDS: dict[str, BandPolicy] = _default_bands()


class FlowPolicy(_Strict):
    fairness: Literal["vtc", "arrival"] = Field(
        default="vtc", description="inside a band: least virtual counter first (vtc) or arrival order"
    )
    shortest_job_first: bool = Field(default=False, description="inside one tenant, least predicted cost first")
    bands: dict[Literal["critical", "high", "normal", "low", "sheddable"], BandPolicy] = Field(
        default_factory=dict, description="per band; bands left out keep their defaults"
    )

    def band(self, name: str) -> BandPolicy:
        found = self.bands.get(name)  # type: ignore[call-overload]
        return found if found is not None else _DEFAULT_BANDS[name]


@dataclass(frozen=True, slots=True)
class Held:
    """A waiting request as the bounds see it."""

    seq: int
    band: int
    tenant: str
    body_bytes: int


def shed_for(
    held: Sequence[Held],
    counter: Callable[[int, str], float],
    *,
    band: int,
    body_bytes: int,
    max_queued: int,
    max_queued_bytes: int,
) -> list[int] | None:
    """The `seq`s to shed so that a newcomer of `band` and `body_bytes` fits (empty: it fits as is);
    None when it cannot fit without displacing its own band or a higher one (turn it away)."""
    count = len(held) + 1
    total = sum(h.body_bytes for h in held) + body_bytes
    if count <= max_queued and total <= max_queued_bytes:
        return []
    if body_bytes > max_queued_bytes:
        return None
    victims = sorted(
        (h for h in held if h.band > band),
        key=lambda h: (-h.band, -counter(h.band, h.tenant), -h.seq),
    )
    shed: list[int] = []
    for victim in victims:
        if count <= max_queued and total <= max_queued_bytes:
            break
        shed.append(victim.seq)
        count -= 1
        total -= victim.body_bytes
    if count <= max_queued and total <= max_queued_bytes:
        return shed
    return None


def retry_after_s(ahead: int, drain_per_s: float, *, unknown_s: float, floor_s: int = 1, cap_s: int = 60) -> int:
    """Whole seconds until `ahead` requests have left at `drain_per_s`; `unknown_s` when nothing has
    drained lately (no rate to go by)."""
    seconds = (ahead + 1) / drain_per_s if drain_per_s > 1e-9 else unknown_s
    return int(min(max(math.ceil(seconds), floor_s), cap_s))


class DrainRate:
    """Dispatches per second out of a waiting room, exponentially decayed over `time_constant_s`."""

    __slots__ = ("_at_s", "_rate", "time_constant_s")

    def __init__(self, time_constant_s: float = 10.0) -> None:
        self.time_constant_s = time_constant_s
        self._rate = 0.0
        self._at_s = 0.0

    def record(self, now_s: float, count: int = 1) -> None:
        self._rate = self.per_s(now_s) + count / self.time_constant_s
        self._at_s = now_s

    def per_s(self, now_s: float) -> float:
        if not self._rate:
            return 0.0
        return self._rate * math.exp(-max(now_s - self._at_s, 0.0) / self.time_constant_s)


REASON_QUEUE_FULL: Final = "queue_full"
REASON_QUEUE_TIMEOUT: Final = "queue_timeout"
REASON_SHED: Final = "queue_shed"

_WHY: Final = {
    REASON_QUEUE_TIMEOUT: "waited {waited:.0f} ms in the {band} band's queue, its limit",
    REASON_QUEUE_FULL: "found the queue full",
    REASON_SHED: "was displaced from the queue by higher-priority traffic after {waited:.0f} ms",
}


def queue_rejection(
    reason: str, *, model: str, band: str, waited_ms: float, retry_after_s: int, status: int = 503
) -> Rejection:
    """The answer to a request leaving the queue for `reason` (status 429 or 503 for a timeout)."""
    why = _WHY.get(reason, "left the queue").format(waited=waited_ms, band=band)
    message = f"The engines serving '{model}' are saturated and this request {why}. Retry in {retry_after_s} s."
    headers = (("retry-after", str(retry_after_s)), ("retry-after-ms", str(retry_after_s * 1000)))
    if status == 429 and reason == REASON_QUEUE_TIMEOUT:
        return Rejection(429, message, "requests", "rate_limit_exceeded", headers=headers, reason=reason)
    return Rejection(503, message, "server_error", reason, headers=headers, reason=reason)
