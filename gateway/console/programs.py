"""`GET /admin/programs`: the live agent runs and what each has spent, for the console's Programs page.

The runs come from the limiter's index of live runs (policies/limits/standing.py: the runs whose calls
were admitted last, in Redis when the gateway shares state, so any replica answers for all) and what
each used from the run's own counters, the ones `GET /v1/key?program=` reads: calls, tokens, dollars,
its wall-clock cap, every run cap with what is left. Bounded: the newest `READ_MAX` index entries are
read, at most `PEEK_MAX` runs (after the tenant and team filter) are looked up, one peek each, all
at once; then ordered by spend or by their last call. A team admin sees its teams' tenants' runs only.

A run no run rule counts has no counters and is not in that index: its row comes from the ledger
instead (gateway/console/tenant_spend.py: this month's records summed per run, up to `TTL_S` old,
every replica's with the ledger's Redis stream), `source: "ledger"`, with no caps and no clock. A run
in both is shown once, from its counters (exact, with its caps).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
from aiohttp import web

from gateway.app import keys as appkeys
from gateway.console.tenant_spend import RunTotals
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.team_scope import team_view
from policies.limits.memory_store import READ_MAX, RunSeen
from policies.limits.standing import order, run_standing
from policies.policy import Policy
from policies.types import RequestSubjects

log = logging.getLogger("tokenway.console")
PEEK_MAX = 200  # runs one listing reads the counters of
DEFAULT_LIMIT = 50
SORTS = ("spend", "recent")


async def programs(request: web.Request) -> web.StreamResponse:
    """The live runs (`?tenant=`, `?sort=spend|recent`, `?limit=` 1-200), each with its caps."""
    sort = request.query.get("sort", "spend")
    if sort not in SORTS:
        return admin_error(400, f"sort: expected one of {', '.join(SORTS)}", "sort")
    try:
        limit = int(request.query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= PEEK_MAX:
        return admin_error(400, f"limit: expected a whole number from 1 to {PEEK_MAX}", "limit")
    tenant = request.query.get("tenant") or None
    policy = request.app[appkeys.POLICIES].current
    store: Any = request.app[appkeys.ADMISSION].store
    seen: list[RunSeen] = await store.recent_runs(READ_MAX) if hasattr(store, "recent_runs") else []
    view = team_view(request)  # a team admin: its teams' tenants' runs only

    def shown(name: str) -> bool:
        return (tenant is None or name == tenant) and (view is None or view.sees_tenant(name))

    wanted = [run for run in seen if shown(run.tenant)][:PEEK_MAX]
    rows = list(await asyncio.gather(*(_row(request, policy, store, run) for run in wanted)))
    reply: dict[str, Any] = {"sort": sort, "runs_read": len(wanted)}
    spend = request.app.get(appkeys.TENANT_SPEND)
    if spend is not None:
        counted = {(run.tenant, run.program) for run in seen}
        try:
            runs, reply["ledger"] = await spend.runs()
        except (OSError, ValueError, redis.RedisError) as exc:  # stream unreachable: the counted runs answer
            log.warning("agent runs from the ledger unavailable: %s", exc)
            reply["ledger"] = {"error": "unavailable"}
            runs = []
        rows += [_ledger_row(run) for run in runs if (run.tenant, run.program) not in counted and shown(run.tenant)]
    reply["data"] = order(rows, sort)[:limit]
    return json_reply(reply)


def _ledger_row(run: RunTotals) -> dict[str, Any]:
    return {
        "tenant": run.tenant,
        "program": run.program,
        "key_id": run.key_id,
        "model": run.model,
        "last_seen": round(run.last_s, 3),
        "calls": run.calls,
        "tokens": run.tokens,
        "spent_usd": round(run.usd, 6),
        "started_at": round(run.first_s, 3),
        "seconds_left": None,
        "caps": [],
        "source": "ledger",
    }


async def _row(request: web.Request, policy: Policy, store: Any, run: RunSeen) -> dict[str, Any]:
    row: dict[str, Any] = {
        "tenant": run.tenant,
        "program": run.program,
        "key_id": run.key_id,
        "model": run.model,
        "last_seen": round(run.last_seen_s, 3),
        "source": "counters",
    }
    empty: dict[str, Any] = {
        "calls": None,
        "tokens": None,
        "spent_usd": None,
        "started_at": None,
        "seconds_left": None,
        "caps": [],
    }
    directory = request.app[appkeys.DIRECTORY]
    principal = directory.principal(run.key_id, policy) if run.key_id in directory.keys else None
    if principal is None:
        principal = policy.file_principal(run.key_id)
    if principal is None:  # its key is gone: the counters are keyed by rule, which needs the key's plan
        return {**row, **empty}
    plan = policy.admission_plan(principal, run.model, RequestSubjects(program=run.program))
    if plan.run is None:  # no run rule applies any more
        return {**row, **empty}
    return {**row, **(await run_standing(store, plan))}
