"""`GET /admin/programs`: the live agent runs and what each has spent, for the console's Programs page.

The runs come from the limiter's index of live runs (policies/limits/standing.py: the runs whose calls
were admitted last, in Redis when the gateway shares state, so any replica answers for all) and what
each used from the run's own counters, the ones `GET /v1/key?program=` reads: calls, tokens, dollars,
its wall-clock cap, every run cap with what is left. Bounded: the newest `READ_MAX` index entries are
read, at most `PEEK_MAX` runs (after the tenant and team filter) are looked up, one peek each, all
at once; then ordered by spend or by their last call. A team admin sees its teams' tenants' runs only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.team_scope import team_view
from policies.limits.memory_store import READ_MAX, RunSeen
from policies.limits.standing import order, run_standing
from policies.policy import Policy
from policies.types import RequestSubjects

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
    if not hasattr(store, "recent_runs"):
        return json_reply({"data": [], "sort": sort, "runs_read": 0})
    seen: list[RunSeen] = await store.recent_runs(READ_MAX)
    view = team_view(request)  # a team admin: its teams' tenants' runs only
    wanted = [
        run
        for run in seen
        if (tenant is None or run.tenant == tenant) and (view is None or view.sees_tenant(run.tenant))
    ][:PEEK_MAX]
    rows = await asyncio.gather(*(_row(request, policy, store, run) for run in wanted))
    return json_reply({"data": order(rows, sort)[:limit], "sort": sort, "runs_read": len(wanted)})


async def _row(request: web.Request, policy: Policy, store: Any, run: RunSeen) -> dict[str, Any]:
    row: dict[str, Any] = {
        "tenant": run.tenant,
        "program": run.program,
        "key_id": run.key_id,
        "model": run.model,
        "last_seen": round(run.last_seen_s, 3),
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
