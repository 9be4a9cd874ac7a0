"""What the planner expects ahead: what it learns from what it measures (a short forecast of each
token rate, and how long a replica takes to start or wake) and what operators announce (scheduled
floors, kept a start-up early).

A short forecast of a token rate: exponential smoothing with a trend (Holt's linear method).

The planner must start replicas a start-up time before the load needs them, so it looks ahead by
that time on the rate's level and trend instead of reacting to the last window alone:

    level_t = a·rate_t + (1 - a)·(level + trend·dt)
    trend_t = b·(level_t - level) / dt + (1 - b)·trend
    forecast(h) = max(0, level_t + trend_t·h)

A smoothed level trails a step: after a 5x burst begins it reads about 3x, and the planner asks
for its replicas a pass later than a planner that counts the engines' busy slots. So a window whose
arrivals are improbably many for the forecast (`stepped_up`: more than `z` Poisson deviations above
the expected count) is a step, not noise: the level takes that window's rate at once (`update(...,
step=True)`) and the trend folds in the rise as usual. A window that holds the step's start reads
under the new rate (part of it came before): the caller passes the rate of the window's second half
(gateway/autoscale/loop.py), which takes a step only when the replicas running cannot absorb it. Falls
stay smoothed: a scale-down waits for the measured level anyway.

A pure value: `update` returns the next forecast; the caller keeps it.

Start-up and wake-up times are learnt per pool from the replicas the executor launched and woke
(`LeadTimes`, handed to `backends.autoscale.executor.Executor`, which times every start and wake).
The planner looks ahead by this lead time and the cold-start hold quotes it in `retry-after`: a
replica asked for now serves after about one start-up. The learnt value is the median of the last
few measurements (one slow launch, a first compile, does not move it much); before any, the pool's
`autoscale.startup_s` or a default.

Scheduled capacity: floors an operator announces ahead, which the planner keeps a start-up early.

A reactive planner sees a burst only once it arrives and serves it a start-up time late; a burst
shorter than a few start-ups is mostly over by then. Operators often know the event ahead (a launch,
a daily peak), so production autoscalers also take scheduled capacity: KEDA's cron scaler
(keda.sh/docs/latest/scalers/cron/) and AWS Auto Scaling's scheduled actions
(docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-scheduled-scaling.html). Here a
floor is a planner input with two sources:

    autoscale.schedule in gateway.yaml   daily windows (UTC "HH:MM", optional days, may wrap midnight)
    PUT /admin/pools/{pool}/floor        a one-off floor: from start_in_s, for for_s

Both become `Floor` values on the planner's monotonic clock (`schedule_floors` resolves the windows
near now; a schedule entry arrives parsed, as `backends.autoscale.config.Window`), so a planning
pass stays a pure function of its signals and a recorded pass replays.
`floor_at` is the floor in force: the largest floor whose window, started `lead_s` early, covers
now, so the replicas it asks for are ready when the window opens. A floor that came in force stays
in force until it ends (`in_force` names them for the planner's memory): the lead is learnt, and
once the first start shows the replicas come up faster than the prior said, a floor whose early
opening the shorter lead no longer covers would otherwise stop the replicas it had just started and
start them again at the window. After the window the floor just ends; the scale-down follows the
planner's usual stabilisation and cooldown.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from backends.autoscale.config import Window

DEFAULT_STARTUP_S = 30.0
DEFAULT_WAKE_S = 5.0
_KEPT = 5


@dataclass(frozen=True, slots=True)
class Forecast:
    level: float = 0.0  # tokens/s now (smoothed)
    trend: float = 0.0  # tokens/s per second
    at_s: float = 0.0  # when it was last updated (monotonic); 0 = never

    def ahead(self, horizon_s: float) -> float:
        """The rate expected `horizon_s` from `at_s` (never negative)."""
        return max(0.0, self.level + self.trend * max(horizon_s, 0.0))

    def update(self, rate: float, now_s: float, alpha: float, beta: float, *, step: bool = False) -> Forecast:
        """Fold in the rate measured over the interval that ends at `now_s`; with `step`, a rate
        above the prediction becomes the level at once."""
        if self.at_s == 0.0:
            return Forecast(rate, 0.0, now_s)
        dt = now_s - self.at_s
        if dt <= 0:
            return self
        predicted = self.level + self.trend * dt
        level = rate if step and rate > predicted else alpha * rate + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        return Forecast(max(level, 0.0), trend, now_s)


def stepped_up(count: float, expected: float, z: float) -> bool:
    """Whether `count` arrivals in a window are a step up from `expected` (their forecast): more than
    `z` standard deviations of a Poisson count above it (z <= 0: never)."""
    return z > 0 and count > expected + z * math.sqrt(max(expected, 1.0))


class LeadTimes:
    """Measured start-up and wake-up times per pool; their medians are the planner's lead."""

    def __init__(self) -> None:
        self._starts: dict[str, deque[float]] = {}
        self._wakes: dict[str, deque[float]] = {}
        self._guess: dict[str, float] = {}

    def guess(self, pool: str, startup_s: float) -> None:
        """The start-up time to assume before one is measured."""
        self._guess[pool] = startup_s

    def observe_start(self, pool: str, seconds: float) -> None:
        self._starts.setdefault(pool, deque(maxlen=_KEPT)).append(seconds)

    def observe_wake(self, pool: str, seconds: float) -> None:
        self._wakes.setdefault(pool, deque(maxlen=_KEPT)).append(seconds)

    def startup_s(self, pool: str) -> float:
        found = self._starts.get(pool)
        return statistics.median(found) if found else self._guess.get(pool, DEFAULT_STARTUP_S)

    def wake_s(self, pool: str) -> float:
        found = self._wakes.get(pool)
        return statistics.median(found) if found else min(DEFAULT_WAKE_S, self.startup_s(pool))

    def measured(self, pool: str) -> dict[str, list[float]]:
        return {
            "starts_s": [round(x, 3) for x in self._starts.get(pool, ())],
            "wakes_s": [round(x, 3) for x in self._wakes.get(pool, ())],
        }


MAX_FLOORS: Final = 16  # set through the admin API, per pool
_DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Floor:
    """At least `min_replicas` of `role` ("" = every role of the pool) from `start_s` to `end_s`
    (the planner's monotonic seconds)."""

    start_s: float
    end_s: float
    min_replicas: int
    role: str = ""
    source: str = "admin"  # admin | schedule HH:MM-HH:MM

    def applies_to(self, role: str) -> bool:
        return not self.role or self.role == role


def schedule_floors(
    windows: Sequence[Window], unix_s: float, now_s: float, horizon_s: float = _DAY_S
) -> tuple[Floor, ...]:
    """The occurrences of `windows` that are open at `unix_s` or open within `horizon_s`, as floors on
    the monotonic clock whose now is `now_s`. A window belongs to the day it starts on (a "fri 22:00-
    02:00" window runs into saturday)."""
    if not windows:
        return ()
    offset = now_s - unix_s
    today = datetime.fromtimestamp(unix_s, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    found: list[Floor] = []
    for back in (-1, 0, 1):
        day = today + timedelta(days=back)
        for window in windows:
            if window.days and day.weekday() not in window.days:
                continue
            start = day.timestamp() + window.start_min * 60.0
            end = start + window.length_s
            if end <= unix_s or start > unix_s + horizon_s:
                continue
            for role, count in window.min_replicas.items():
                found.append(Floor(start + offset, end + offset, count, role, window.label))
    return tuple(found)


def _opened(floor: Floor, now_s: float, lead_s: float, kept: Sequence[Floor]) -> bool:
    if now_s >= floor.end_s:
        return False
    return floor.start_s - lead_s <= now_s or any(_same(floor, k) for k in kept)


def _same(a: Floor, b: Floor) -> bool:
    """One floor across passes: a schedule's floors are rebuilt each pass on a monotonic clock whose
    offset to the wall clock moves by microseconds, so their times match to within a second."""
    return (
        a.source == b.source
        and a.role == b.role
        and a.min_replicas == b.min_replicas
        and abs(a.start_s - b.start_s) < 1.0
        and abs(a.end_s - b.end_s) < 1.0
    )


def in_force(floors: Iterable[Floor], now_s: float, lead_s: float, kept: Sequence[Floor] = ()) -> tuple[Floor, ...]:
    """The floors in force at `now_s` for any role: opened `lead_s` early, or in force at the last pass
    (`kept`) and not ended. The planner keeps them in its memory and passes them back as `kept`."""
    return tuple(f for f in floors if _opened(f, now_s, lead_s, kept))


def floor_at(
    floors: Iterable[Floor], role: str, now_s: float, lead_s: float, kept: Sequence[Floor] = ()
) -> tuple[int, Floor | None]:
    """The floor in force for `role` at `now_s`: the largest one whose window, opened `lead_s` early
    (the time a replica asked for now takes to serve), or kept from the last pass, has not ended."""
    best: Floor | None = None
    for floor in floors:
        opened = floor.applies_to(role) and _opened(floor, now_s, lead_s, kept)
        if opened and (best is None or floor.min_replicas > best.min_replicas):
            best = floor
    return (best.min_replicas, best) if best is not None else (0, None)


def describe(floor: Floor, now_s: float) -> str:
    """The planner's reason for a floor in force."""
    if now_s < floor.start_s:
        return f"scheduled floor {floor.min_replicas} ({floor.source}) opens in {floor.start_s - now_s:.0f} s"
    return f"scheduled floor {floor.min_replicas} ({floor.source}) for {floor.end_s - now_s:.0f} s"


def keep(floors: Sequence[Floor], now_s: float) -> list[Floor]:
    """The floors that have not ended (what an admin floor list keeps)."""
    return [f for f in floors if f.end_s > now_s]


def view(floor: Floor, now_s: float) -> dict[str, object]:
    """A floor as `/admin/pools` and the floor API show it (times relative to now)."""
    return {
        "min_replicas": floor.min_replicas,
        "role": floor.role or None,
        "source": floor.source,
        "active": floor.start_s <= now_s < floor.end_s,
        "starts_in_s": round(max(0.0, floor.start_s - now_s), 3),
        "ends_in_s": round(floor.end_s - now_s, 3),
    }
