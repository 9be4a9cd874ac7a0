"""The shared store: buckets, leases and budgets in Redis, one EVALSHA per admit and one per settle.

Every key carries the hash tag `{prefix}` so a request's keys share one slot: on Redis Cluster the
whole limiter lives on one shard, which is what lets one atomic script cover every bucket (the
alternative, one call per slot, gives up atomicity). The script uses Redis's own clock, so replicas
with skewed clocks still drain buckets identically. Calls made in the same event-loop turn share one
pipelined write (`AutoPipeline`), which also reloads the scripts after a NOSCRIPT (Redis restart,
failover, SCRIPT FLUSH).

Reservations are idempotent by ticket id: reserving a ticket twice charges it once, and a ticket
voided (`void`, after a reply was lost) can no longer be reserved, so a reservation that runs in Redis
after its caller gave up on it is refused or undone whichever order the two arrive in.

This class talks to Redis only; failure handling (breaker, fail-open, replay) is `FailoverStore`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policies.limits import memory_store
from policies.limits.memory_store import INDEX_MAX, RunSeen, parse_entry
from policies.limits.plan import Charge, Outcome, Plan, Settlement, ticket_ttl_s
from policies.limits.scriptpipe import Arg, EvalSha, Pre, Script, load_script, script_pipeline

MARKER_TTL_S = 86_400  # fail-open charges replayed after an outage are deduplicated this long
_MARKER_TTL = Pre(str(MARKER_TTL_S))
_TICKET_MODE = Pre("z")


class VoidedTicket(Exception):
    """The ticket was voided before its reservation ran (a caller retried a ticket it gave up on)."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _script(name: str) -> Script:
    return load_script("policies.limits", name)


def _flag(shadow: bool) -> str:
    return "1" if shadow else "0"


_REDIS_TIME = Pre("")  # the scripts read Redis's clock


def _now_arg(now_s: float | None) -> Arg:
    return _REDIS_TIME if now_s is None else repr(now_s)


class RedisStore:
    """Reserve/settle scripts over one Redis client; raises redis errors to the caller."""

    source = "redis"

    def __init__(self, client: Redis, *, prefix: str = "tokenway", batch: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self._tag = "{" + prefix + "}:"
        self._tickets = self._tag + "tickets"
        self._voided = self._tag + "voided"
        self._runs = self._tag + "runs"  # the index of live agent runs (policies/limits/standing.py)
        self._runs_meta = self._tag + "runs:by"
        self._reserve = _script("reserve.lua")
        self._settle = _script("settle.lua")
        self._void = _script("void.lua")
        self._peek = _script("peek.lua")
        self.pipeline = script_pipeline(client, (self._reserve, self._settle, self._void, self._peek), batch=batch)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "tokenway", timeout_s: float = 0.1, batch: bool = True) -> RedisStore:
        """A client for the hot path: short timeouts and no client-side retries (the breaker decides)."""
        client = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        return cls(client, prefix=prefix, batch=batch)

    async def close(self) -> None:
        close = getattr(self.pipeline, "close", None)
        if close is not None:
            await close()
        await self.client.aclose()

    def key(self, kind: str, name: str) -> str:
        """The Redis key of a bucket (b), lease (c) or budget (u)."""
        return f"{self._tag}{kind}:{name}"

    def _encoded(self, plan: Plan) -> _Encoded:
        """Keys and the static script arguments of `plan`, built once per plan and store prefix."""
        encoded = plan.encoded.get(self._tag)
        if encoded is None:
            encoded = plan.encoded[self._tag] = _Encoded(self, plan)
        return encoded

    async def reserve(self, plan: Plan, charge: Charge, now_s: float | None = None) -> Outcome:
        enc = self._encoded(plan)
        args = [
            _now_arg(now_s),
            charge.ticket_id,
            enc.lease_ttl,
            enc.ticket_ttl,
            repr(charge.cost_usd),
            enc.reserve_plan,
            " ".join(map(repr, charge.bucket_costs)),
            *enc.run_args,
        ]
        reply = await self.pipeline.send(enc.reserve, args)
        if reply[0] == b"v":
            raise VoidedTicket(charge.ticket_id)
        nb, nl, nu = len(plan.buckets), len(plan.leases), len(plan.budgets)
        i = 2
        used = [float(v) for v in reply[i : i + nb]]
        i += nb
        active = [int(v) for v in reply[i : i + nl]]
        i += nl
        spent = [float(v) for v in reply[i : i + nu]]
        i += nu
        periods = [int(v) for v in reply[i : i + nu]]
        return Outcome(reply[0] == b"1", float(reply[1]), used, active, spent, periods, self.source)

    async def recent_runs(self, limit: int, now_s: float | None = None) -> list[RunSeen]:
        """The agent runs admitted last, newest first (at most `limit`), from the index reserve.lua
        keeps; entries idle past the counters' expiry are skipped."""
        reply: Any = await self.client.zrevrange(self._runs, 0, max(0, limit - 1), withscores=True)
        found: list[tuple[bytes | str, float]] = [(member, float(score)) for member, score in reply or ()]
        if not found:
            return []
        subjects = [_text(member) for member, _ in found]
        metas: list[bytes | str | None] = await self.client.hmget(self._runs_meta, subjects)
        latest = float(now_s) if now_s is not None else None
        out: list[RunSeen] = []
        for (_, score), subject, meta in zip(found, subjects, metas, strict=True):
            if meta is None:
                continue
            if latest is not None and latest - float(score) > memory_store.IDLE_TTL_S:
                continue
            seen = parse_entry(subject, float(score), _text(meta))
            if seen is not None:
                out.append(seen)
        return out

    async def void(self, plan: Plan, charge: Charge, now_s: float | None = None) -> bool:
        """Make sure `charge` holds nothing in Redis, whether or not its reservation ran (or will).
        True when a reservation was found and undone."""
        enc = self._encoded(plan)
        args = [
            _now_arg(now_s),
            charge.ticket_id,
            enc.ticket_ttl,
            enc.ticket_ttl,
            repr(charge.cost_usd),
            enc.settle_plan,
            " ".join(map(repr, charge.bucket_costs)),
        ]
        return bool(int(await self.pipeline.send(enc.void, args)))

    async def peek(self, plan: Plan, now_s: float | None = None) -> Outcome:
        """The plan's buckets, leases and budgets as they stand, charging nothing."""
        enc = self._encoded(plan)
        reply = await self.pipeline.send(enc.peek, [_now_arg(now_s), enc.reserve_plan])
        nb, nl, nu = len(plan.buckets), len(plan.leases), len(plan.budgets)
        i = 1
        used = [float(v) for v in reply[i : i + nb]]
        i += nb
        active = [int(v) for v in reply[i : i + nl]]
        i += nl
        spent = [float(v) for v in reply[i : i + nu]]
        i += nu
        periods = [int(v) for v in reply[i : i + nu]]
        return Outcome(True, float(reply[0]), used, active, spent, periods, self.source)

    async def apply(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> bool:
        """Settle a ticket Redis reserved. False when it was settled before (or had expired)."""
        return bool(int(await self.apply_future(plan, settlement, now_s, lazy=False)))

    def apply_future(
        self, plan: Plan, settlement: Settlement, now_s: float | None = None, *, lazy: bool = True
    ) -> asyncio.Future[Any]:
        """`apply`'s command queued now (before this returns); the future holds Redis's reply. `lazy`:
        nobody waits for it, so it may wait (briefly) to share the next write (`ScriptPipe`)."""
        enc = self._encoded(plan)
        args = [
            _now_arg(now_s),
            settlement.ticket_id,
            _TICKET_MODE,
            _MARKER_TTL,
            repr(settlement.budget_delta_usd),
            enc.settle_plan,
            " ".join(map(repr, settlement.bucket_deltas)),
            " ".join(map(str, settlement.budget_periods)),
        ]
        return asyncio.ensure_future(self.pipeline.send(enc.settle, args, lazy=lazy))

    async def charge_budgets(self, plan: Plan, settlement: Settlement, now_s: float | None = None) -> bool:
        """Charge the real cost of a request admitted locally while Redis was down, exactly once: to
        the budgets, and (`settlement.actual_bucket_costs`) to the shared buckets, where it stands as
        debt if the replicas' shares together went past the limit."""
        enc = self._encoded(plan)
        with_buckets = len(settlement.actual_bucket_costs) == len(plan.buckets) and any(settlement.actual_bucket_costs)
        args: list[Any] = [
            "" if now_s is None else repr(now_s),
            settlement.ticket_id,
            "m",
            MARKER_TTL_S,
            repr(settlement.actual_cost_usd),
            (enc.charge_plan if with_buckets else enc.marker_plan).value,
            " ".join(map(repr, settlement.actual_bucket_costs)) if with_buckets else "",
            " ".join(map(str, settlement.budget_periods)),
        ]
        buckets = enc.bucket_keys if with_buckets else []
        keys = [self._tag + "m:" + settlement.ticket_id, *buckets, *enc.budget_keys]
        return bool(int(await self.pipeline.call(self._settle, keys, args)))


class _Encoded:
    """A plan as the scripts take it: key names, the space-separated static parameters, and the
    commands' fixed parts encoded once (`EvalSha`, `Pre`)."""

    __slots__ = (
        "bucket_keys",
        "budget_keys",
        "charge_plan",
        "keys",
        "lease_ttl",
        "marker_plan",
        "peek",
        "reserve",
        "reserve_keys",
        "reserve_plan",
        "run_args",
        "settle",
        "settle_plan",
        "ticket_ttl",
        "void",
    )

    def __init__(self, store: RedisStore, plan: Plan) -> None:
        tag = store._tag
        self.bucket_keys = bucket_keys = [tag + "b:" + spec.key for spec in plan.buckets]
        lease_keys = [tag + "c:" + lease.key for lease in plan.leases]
        self.budget_keys = [tag + "u:" + budget.key for budget in plan.budgets]
        self.keys = [store._tickets, *bucket_keys, *lease_keys, *self.budget_keys]
        self.reserve_keys = [store._tickets, store._voided, *bucket_keys, *lease_keys, *self.budget_keys]
        counts = [str(len(plan.buckets)), str(len(plan.leases)), str(len(plan.budgets))]
        reserve = list(counts)
        for spec in plan.buckets:
            reserve += (repr(spec.capacity), repr(spec.rate_per_s), _flag(spec.shadow))
        for lease in plan.leases:
            reserve += (str(lease.capacity), _flag(lease.shadow))
        for budget in plan.budgets:
            reserve += (repr(budget.limit_usd), budget.period, _flag(budget.shadow))
        self.reserve_plan = Pre(" ".join(reserve))
        periods = [budget.period for budget in plan.budgets]
        self.settle_plan = Pre(" ".join([*counts, *(repr(spec.rate_per_s) for spec in plan.buckets), *periods]))
        self.marker_plan = Pre(" ".join(["0", "0", str(len(plan.budgets)), *periods]))
        rates = [repr(spec.rate_per_s) for spec in plan.buckets]
        self.charge_plan = Pre(" ".join([str(len(plan.buckets)), "0", str(len(plan.budgets)), *rates, *periods]))
        self.lease_ttl = Pre(repr(plan.settings.lease_ttl_s))
        self.ticket_ttl = Pre(repr(ticket_ttl_s(plan.settings.lease_ttl_s)))
        run = plan.run
        self.run_args: tuple[Pre, ...] = ()
        reserve_keys = self.reserve_keys
        if run is not None:  # the run's calls also note it in the index of live runs
            reserve_keys = [*reserve_keys, store._runs, store._runs_meta]
            self.run_args = (Pre(run.subject), Pre(f"{run.key_id} {plan.model}"), Pre(str(INDEX_MAX)))
        self.reserve = EvalSha(store._reserve, reserve_keys, 7 + len(self.run_args))
        self.void = EvalSha(store._void, self.reserve_keys, 7)
        self.settle = EvalSha(store._settle, self.keys, 8)
        self.peek = EvalSha(store._peek, self.keys, 2)
