"""What the console's overview and live tail show: this replica's last hour, minute by minute, and
its most recent requests (metadata only: no prompt or completion text ever reaches a record).

A record sink like the metrics and the ledger: `observe` adds one finished request to the current
minute's counters and to a bounded ring. Memory is 60 minute buckets and `tail_size` small dicts.
SLO attainment counts requests of an SLO class: met when the observed TTFT (and TPOT) are within the
class's targets, missed when not or when the request was turned away as `slo_unattainable`.

Each minute also counts per model (the overview's per-model latency and error charts): requests,
errors, the summed duration of those served, and for streamed ones the TTFT's count, sum and a
fixed-bucket histogram (`ttft_le_ms`, cumulative-free counts per upper bound) from which a p90 is
read within a bucket's width. Percentiles cannot be summed across replicas; bucket counts can, and
every field of `models` is a number or a dict of numbers, so shared.py sums it like the rest. The map
is bounded by the models of policies.yaml (`MAX_MODELS` at most); any other name counts as `(other)`.

Each minute also counts per team (`teams`: the minute's scalar counters, requests to SLO, for the
requests of the tenants of each team; `team_models`: the per-model counters above, per team), so
that a team admin's overview, its per-model charts included, is its teams' own figures rather than a
share of everyone's (gateway/http/team_scope.py). The team is looked up from the record's tenant in
policies.yaml, then in the admin API's directory; a tenant of no team counts in no team. The maps
are bounded by the teams of policies.yaml (a tenant may only name one of those), times `MAX_MODELS`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.request.record import RequestRecord
from policies.policy import Policy
from policies.schema import PoliciesConfig

MINUTES = 60
TAIL_SIZE = 200
MAX_MODELS = 64  # per-model counters per minute, beyond which models count as OTHER
OTHER = "(other)"
TTFT_BOUNDS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10000)  # and "inf" above the last
_TTFT_KEYS = tuple((bound, str(bound)) for bound in TTFT_BOUNDS_MS)  # each bound and its key, made once


def _model_counters() -> dict[str, Any]:
    return {
        "requests": 0,
        "errors": 0,
        "served": 0,
        "duration_sum_ms": 0.0,
        "ttft_n": 0,
        "ttft_sum_ms": 0.0,
        "ttft_le_ms": {str(b): 0 for b in (*TTFT_BOUNDS_MS, "inf")},
    }


TEAM_FIELDS = (
    "requests",
    "served",
    "rejected",
    "errors",
    "fallbacks",
    "input_tokens",
    "output_tokens",
    "cost_usd",
    "slo_requests",
    "slo_met",
)


@dataclass(slots=True)
class _Minute:
    start_s: int
    requests: int = 0
    served: int = 0
    rejected: int = 0
    errors: int = 0
    fallbacks: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    slo_requests: int = 0
    slo_met: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    teams: dict[str, dict[str, float]] = field(default_factory=dict)
    team_models: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": self.start_s,
            "requests": self.requests,
            "served": self.served,
            "rejected": self.rejected,
            "errors": self.errors,
            "fallbacks": self.fallbacks,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": round(self.cost_usd, 9),
            "slo_requests": self.slo_requests,
            "slo_met": self.slo_met,
            "models": _models_dict(self.models),
            "teams": {name: {**c, "cost_usd": round(c["cost_usd"], 9)} for name, c in self.teams.items()},
            "team_models": {name: _models_dict(models) for name, models in self.team_models.items()},
        }


def _models_dict(models: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            **m,
            "ttft_le_ms": dict(m["ttft_le_ms"]),
            "duration_sum_ms": round(m["duration_sum_ms"], 3),
            "ttft_sum_ms": round(m["ttft_sum_ms"], 3),
        }
        for name, m in models.items()
    }


def summed(into: Any, value: Any) -> Any:
    """Two sets of counters added: numbers summed, dicts of them (a minute's per-model counters)
    summed key by key into a new dict; a field one side lacks is the other's (replicas' minutes,
    gateway/console/shared.py; a team admin's teams, `team_overview`)."""
    if isinstance(value, dict):
        merged = dict(into) if isinstance(into, dict) else {}
        for key, part in value.items():
            merged[key] = summed(merged.get(key), part)
        return merged
    return value if into is None else into + value


class ConsoleActivity:
    def __init__(
        self,
        policy: Callable[[], Policy],
        *,
        tail_size: int = TAIL_SIZE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._minutes: deque[_Minute] = deque(maxlen=MINUTES)
        self._tail: deque[tuple[int, RequestRecord]] = deque(maxlen=tail_size)
        self._seq = 0

    def observe(self, record: RequestRecord) -> None:
        now_s = record.started_at_unix_s + record.duration_s
        start = int(now_s // 60) * 60
        minutes = self._minutes
        if not minutes or minutes[-1].start_s < start:
            minutes.append(_Minute(start))
        minute = minutes[-1]
        if minute.start_s == start:  # a record older than the current minute (clock step) is only tailed
            self._count(minute, record)
        self._seq += 1
        self._tail.append((self._seq, record))  # rendered when asked: nothing per request but the append

    def _count(self, minute: _Minute, record: RequestRecord) -> None:
        config = self._policy().config  # read once per record: every count below judges by the same policy
        minute.requests += 1
        status = record.status
        if status == "ok":
            minute.served += 1
        elif status == "rejected":
            minute.rejected += 1
        else:
            minute.errors += 1
        if record.fallback_from:
            minute.fallbacks += 1
        minute.input_tokens += record.prompt_tokens
        minute.output_tokens += record.completion_tokens
        minute.cost_usd += record.cost_usd
        met = self._slo_met(config, record)
        if met is not None:
            minute.slo_requests += 1
            minute.slo_met += int(met)
        self._count_model(config, minute.models, record)
        self._count_team(config, minute, record, met)

    def _count_team(self, config: PoliciesConfig, minute: _Minute, record: RequestRecord, met: bool | None) -> None:
        team = self._team_of(config, record.tenant)
        if team is None:
            return
        self._count_model(config, minute.team_models.setdefault(team, {}), record)
        counters = minute.teams.get(team)
        if counters is None:
            counters = minute.teams[team] = dict.fromkeys(TEAM_FIELDS, 0)
        counters["requests"] += 1
        status = record.status
        counters["served" if status == "ok" else "rejected" if status == "rejected" else "errors"] += 1
        counters["fallbacks"] += 1 if record.fallback_from else 0
        counters["input_tokens"] += record.prompt_tokens
        counters["output_tokens"] += record.completion_tokens
        counters["cost_usd"] += record.cost_usd
        if met is not None:
            counters["slo_requests"] += 1
            counters["slo_met"] += int(met)

    def _team_of(self, config: PoliciesConfig, tenant: str) -> str | None:
        """The team of a tenant of policies.yaml or of the admin API, when it is one of the file's
        teams (the only names a tenant may carry: the map stays bounded by them)."""
        file_tenant = config.tenants.get(tenant)
        if file_tenant is not None:
            team = file_tenant.team
        else:
            directory = self._policy().directory
            record = directory.tenants.get(tenant) if directory is not None and tenant else None
            team = record.team if record is not None else None
        return team if team is not None and team in config.teams else None

    @staticmethod
    def _count_model(config: PoliciesConfig, models: dict[str, dict[str, Any]], record: RequestRecord) -> None:
        name = record.model or record.requested_model
        if name not in config.models or (name not in models and len(models) >= MAX_MODELS):
            name = OTHER  # a name a client made up never becomes a key of the map
        counters = models.get(name)
        if counters is None:
            counters = models[name] = _model_counters()
        counters["requests"] += 1
        status = record.status
        if status == "ok":
            counters["served"] += 1
            counters["duration_sum_ms"] += record.duration_s * 1000.0
        elif status != "rejected":
            counters["errors"] += 1
        if record.ttft_s is not None and status == "ok":
            ttft_ms = record.ttft_s * 1000.0
            counters["ttft_n"] += 1
            counters["ttft_sum_ms"] += ttft_ms
            bound = "inf"
            for limit, key in _TTFT_KEYS:
                if ttft_ms <= limit:
                    bound = key
                    break
            counters["ttft_le_ms"][bound] += 1

    @staticmethod
    def _slo_met(config: PoliciesConfig, record: RequestRecord) -> bool | None:
        name = record.slo_class
        if record.reject_reason == "slo_unattainable":
            return False
        if not name:
            return None
        slo = config.slo_classes.get(str(name))
        if slo is None or record.status != "ok":
            return None if slo is None else False
        if record.ttft_s is None:
            return None  # not streamed: no first token observed, nothing to judge
        if slo.ttft_ms is not None and record.ttft_s * 1000.0 > slo.ttft_ms:
            return False
        return not (slo.tpot_ms is not None and record.tpot_s is not None and record.tpot_s * 1000.0 > slo.tpot_ms)

    def minutes(self) -> list[dict[str, Any]]:
        """The counters of the minutes of the last hour that saw a request (what replicas share)."""
        horizon = int(self._clock() // 60) * 60 - (MINUTES - 1) * 60
        return [m.as_dict() for m in self._minutes if m.start_s >= horizon]

    def overview(self) -> dict[str, Any]:
        """Per-minute counters of the last hour and their totals (rates per second over the span)."""
        return overview_of(self.minutes(), self._clock())

    def tail(
        self, after: int = 0, limit: int = 100, keep: Callable[[dict[str, Any]], bool] | None = None
    ) -> list[dict[str, Any]]:
        """The newest requests after sequence number `after`, newest first; only those `keep` keeps
        (a team admin's: gateway/http/team_scope.py), counted before `limit`."""
        rows = [_row(seq, record) for seq, record in reversed(self._tail) if seq > after]
        if keep is not None:
            rows = [row for row in rows if keep(row)]
        return rows[:limit]


def overview_of(minutes: list[dict[str, Any]], now_s: float) -> dict[str, Any]:
    """Per-minute counters of the last hour and their totals (rates per second over the span), from
    the minutes that saw requests (one replica's, or several replicas' summed: gateway/console/shared.py)."""
    current = int(now_s // 60) * 60
    horizon = current - (MINUTES - 1) * 60
    minutes = sorted((m for m in minutes if m["t"] >= horizon), key=lambda m: m["t"])
    by_start = {m["t"]: m for m in minutes}
    empty = _Minute(0).as_dict()
    dense = [by_start.get(t) or {**empty, "t": t} for t in range(horizon, current + 60, 60)]  # a full hour
    total = (
        {k: sum(m[k] for m in minutes) for k, v in minutes[0].items() if k != "t" and not isinstance(v, dict)}
        if minutes
        else {}
    )
    span_s = max(60.0, now_s - minutes[0]["t"]) if minutes else 60.0
    tokens = total.get("input_tokens", 0) + total.get("output_tokens", 0)
    requests = total.get("requests", 0)
    summary = {
        "window_s": round(span_s, 1),
        "requests_per_s": requests / span_s if minutes else 0.0,
        "tokens_per_s": tokens / span_s if minutes else 0.0,
        "spend_per_hour_usd": total.get("cost_usd", 0.0) / span_s * 3600.0 if minutes else 0.0,
        "cpm_usd": total["cost_usd"] / tokens * 1e6 if tokens else None,
        "error_rate": total["errors"] / requests if requests else None,
        "rejection_rate": total["rejected"] / requests if requests else None,
        "fallback_rate": total["fallbacks"] / requests if requests else None,
        "slo_attainment": total["slo_met"] / total["slo_requests"] if total.get("slo_requests") else None,
        **{k: total.get(k, 0) for k in ("requests", "served", "rejected", "errors", "fallbacks")},
    }
    return {
        "summary": summary,
        "minutes": dense,
        "models": sorted({name for m in minutes for name in m.get("models") or ()}),
    }


def team_overview(minutes: list[dict[str, Any]], teams: frozenset[str], now_s: float) -> dict[str, Any]:
    """The overview of `teams` alone (a team admin's): each minute's counters of those teams summed,
    its per-model counters from those teams' `team_models`, the same summary and dense hour as the
    fleet's, and no per-team breakdown (a minute's `teams` name other teams; its `models` sum every
    team's requests)."""
    own: list[dict[str, Any]] = []
    for minute in minutes:
        parts = [c for name, c in (minute.get("teams") or {}).items() if name in teams]
        if parts:
            models: dict[str, Any] = {}
            for name, counters in (minute.get("team_models") or {}).items():
                if name in teams:
                    models = summed(models, counters)
            counts = {k: sum(p.get(k, 0) for p in parts) for k in TEAM_FIELDS}
            own.append({"t": minute["t"], **counts, "models": models})
    found = overview_of(own, now_s)
    found["minutes"] = [
        {"t": m["t"], **{k: m.get(k, 0) for k in TEAM_FIELDS}, "models": m.get("models") or {}}
        for m in found["minutes"]
    ]
    return found


def _row(seq: int, record: RequestRecord) -> dict[str, Any]:
    finished_s = record.started_at_unix_s + record.duration_s
    return {
        "seq": seq,
        "ts": round(finished_s, 3),
        "request_id": record.request_id,
        "tenant": record.tenant,
        "key_id": record.key_id,
        "program": record.program,
        "api": record.api,
        "requested_model": record.requested_model,
        "model": record.model,
        "fallback": f"{record.fallback_from}->{record.model}" if record.fallback_from else None,
        "endpoint": record.endpoint,
        "stream": record.stream,
        "status": record.status,
        "http_status": record.http_status,
        "reason": record.reject_reason or record.error_code,
        "input_tokens": record.prompt_tokens,
        "output_tokens": record.completion_tokens,
        "cost_usd": round(record.cost_usd, 9),
        "ttft_ms": round(record.ttft_s * 1000.0, 1) if record.ttft_s is not None else None,
        "duration_ms": round(record.duration_s * 1000.0, 1),
    }
