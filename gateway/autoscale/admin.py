"""What operators see and set of the autoscaler from outside the gateway's process: scheduled floors
through the admin API (`/admin/pools/{pool}/floor`), and the autoscale section of `tokenway pools
status` (`/admin/pools` as a table). One module for the autoscaler's operator surfaces: what an
operator sets through the admin API and what the CLI shows of the planner's state.

Scheduled floors through the admin API
--------------------------------------

`/admin/pools/{pool}/floor`: scheduled capacity an operator announces to a running gateway.

    PUT    {"min_replicas": N, "start_in_s": 0, "for_s": S, "role": "decode"}  -> 200 the floor
    GET    the pool's floors (the admin API's and its schedule's open or next windows)
    DELETE drops the admin API's floors (the schedule's change with gateway.yaml)

The planner keeps the floor from a start-up time before `start_in_s` to its end
(policies/autoscale/forecast.py). Errors are in OpenAI's shape like the rest of the admin API: bad
input 400, an unknown pool 404, a pool without `autoscale` 409, a pool already holding
floors.MAX_FLOORS floors that have not ended 409.

`tokenway pools status`' autoscale section
------------------------------------------

`/admin/pools` as a table, decisions under it (`format_pools`).
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from gateway.audit.api import note
from gateway.autoscale.loop import Autoscaler
from gateway.autoscale.wiring import AUTOSCALER
from gateway.http.admin_replies import admin_error, json_reply
from policies.autoscale import forecast as scheduled

_FIELDS = frozenset({"min_replicas", "start_in_s", "for_s", "role"})
_MOST_REPLICAS = 10_000  # a bound on what is stored; the planner still holds a pool within its max_replicas
_LONGEST_S = 7 * 86_400.0  # a one-off floor; a standing one belongs in autoscale.schedule


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _error(refused: _Refused) -> web.Response:
    return admin_error(refused.status, str(refused), refused.param)


def _pool(request: web.Request) -> tuple[Autoscaler, str, list[str]]:
    """The autoscaler, the pool named in the path, and its planned roles."""
    autoscaler = request.app[AUTOSCALER]
    name = request.match_info["pool"]
    if name not in autoscaler.fleet.pools:
        raise _Refused(404, f"no pool named {name!r}")
    roles = autoscaler.roles(name)
    if not roles:
        raise _Refused(409, f"pool {name!r} is not autoscaled: a floor needs autoscale in gateway.yaml")
    return autoscaler, name, roles


def _number(body: dict[str, Any], key: str, default: float | None) -> float:
    value = body.get(key, default)
    if value is None:
        raise _Refused(400, f"{key} is required", key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Refused(400, f"{key} must be a number of seconds", key)
    return float(value)


def parse_floor(raw: bytes, roles: list[str]) -> tuple[int, float, float, str]:
    """(min_replicas, start_in_s, for_s, role) of a PUT body, or _Refused(400)."""
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise _Refused(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _Refused(400, "expected a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _Refused(400, f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(_FIELDS))})", unknown[0])
    count = body.get("min_replicas")
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= _MOST_REPLICAS:
        raise _Refused(400, f"min_replicas must be an integer from 0 to {_MOST_REPLICAS}", "min_replicas")
    start_in_s = _number(body, "start_in_s", 0.0)
    if start_in_s < 0 or start_in_s > _LONGEST_S:
        raise _Refused(400, f"start_in_s must be between 0 and {_LONGEST_S:g}", "start_in_s")
    for_s = _number(body, "for_s", None)
    if for_s <= 0 or for_s > _LONGEST_S:
        raise _Refused(400, f"for_s must be above 0 and at most {_LONGEST_S:g}", "for_s")
    role = body.get("role")
    if role is None:
        return count, start_in_s, for_s, ""
    if role not in ("prefill", "decode"):
        raise _Refused(400, 'role must be "prefill" or "decode"', "role")
    if role not in roles:
        raise _Refused(400, f"this pool plans no {role} role (roles: {', '.join(roles)})", "role")
    return count, start_in_s, for_s, str(role)


def _listing(autoscaler: Autoscaler, name: str) -> dict[str, Any]:
    now = autoscaler.clock()
    return {"pool": name, "floors": [scheduled.view(f, now) for f in autoscaler.pool_floors(name, now)]}


async def floor_put(request: web.Request) -> web.Response:
    try:
        autoscaler, name, roles = _pool(request)
        count, start_in_s, for_s, role = parse_floor(await request.read(), roles)
        before = _listing(autoscaler, name)
        try:
            floor = autoscaler.set_floor(name, count, start_in_s, for_s, role)
        except ValueError as exc:
            raise _Refused(409, str(exc)) from None
    except _Refused as refused:
        return _error(refused)
    note(request, target=name, before=before, after=_listing(autoscaler, name))
    return json_reply({"pool": name, "floor": scheduled.view(floor, autoscaler.clock())})


async def floor_get(request: web.Request) -> web.Response:
    try:
        autoscaler, name, _roles = _pool(request)
    except _Refused as refused:
        return _error(refused)
    return json_reply(_listing(autoscaler, name))


async def floor_delete(request: web.Request) -> web.Response:
    try:
        autoscaler, name, _roles = _pool(request)
    except _Refused as refused:
        return _error(refused)
    before = _listing(autoscaler, name)
    dropped = autoscaler.clear_floors(name)
    after = _listing(autoscaler, name)
    note(request, target=name, before=before, after=after)
    return json_reply({**after, "cleared": dropped})


_COLUMNS = ("pool", "role", "current", "desired", "ready", "starting", "draining", "sleeping", "stopped")


def format_pools(status: dict[str, Any], decisions: int = 5) -> str:
    """Current vs desired per pool and role, the reason, learnt start-up and the last decisions."""
    pools = status.get("pools") or []
    if not pools:
        return ""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for pool in pools:
        for role, info in (pool.get("roles") or {}).items():
            counts = info.get("replicas") or {}
            desired = info.get("desired")
            rows.append(
                (
                    pool["name"],
                    role,
                    str(info.get("current", 0)),
                    "-" if desired is None else str(desired),
                    *(str(counts.get(k, 0)) for k in _COLUMNS[4:]),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [f"autoscale (a pass every {status.get('interval_s', 0):g} s):"]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    for pool in pools:
        lines.append(f"  {pool['name']}: {pool.get('reason', '')}")
        lines.append(
            f"      start-up {pool.get('startup_s', 0):.1f} s, wake {pool.get('wake_s', 0):.1f} s (learnt); "
            f"held {pool.get('held', 0)}; drain timeouts {pool.get('drain_timeouts', 0)}"
        )
        for floor in pool.get("floors") or []:
            when = "now" if floor.get("active") else f"in {floor.get('starts_in_s', 0):.0f} s"
            role = f" {floor['role']}" if floor.get("role") else ""
            lines.append(
                f"      floor {floor.get('min_replicas')}{role} ({floor.get('source')}) {when},"
                f" ends in {floor.get('ends_in_s', 0):.0f} s"
            )
        for decision in (pool.get("decisions") or [])[-decisions:]:
            lines.append(f"      {decision.get('current')} -> {decision.get('desired')}: {decision.get('reason', '')}")
    return "\n".join(lines) + "\n"
