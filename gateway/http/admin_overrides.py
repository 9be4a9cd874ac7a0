"""Temporary overrides of policies.yaml's limits and budgets through the admin API (`/admin/overrides`).

"Raise the team's budget to $500 until Friday" is an operator's everyday request; editing the file
means remembering to edit it back. An override names a rule (its identity, as `/admin/status` and
429 messages show it), a dimension, a value and an end (`until` or `for`), optionally one subject of
the rule (a team, a key, a tag); when it ends, the rule's own value is back by itself. Overrides are
stored with the keys (SQLite, or Redis shared by every replica) and applied by the admission plans
(policies/limits/compile.py), which are rebuilt when one is added, deleted or ends.
"""

from __future__ import annotations

import time

from aiohttp import web

from gateway.app import keys as appkeys
from gateway.audit.api import note
from gateway.http.admin_keys import read_body
from gateway.http.admin_replies import admin_error, json_reply
from gateway.http.routes import Handler
from gateway.http.team_scope import team_view
from policies.keys.directory import DirectoryError


async def overrides_list(request: web.Request) -> web.StreamResponse:
    directory = request.app[appkeys.DIRECTORY]
    now_s = time.time()
    include_ended = request.query.get("include_ended") in ("1", "true", "yes")
    rows = [o.view(now_s) for o in directory.overrides.values() if include_ended or o.until_unix_s > now_s]
    view = team_view(request)
    if view is not None:  # a team admin: overrides of its teams' keys, tenants and teams only
        rows = [row for row in rows if view.sees_override(row)]
    rows.sort(key=lambda row: (row["until"], row["id"]))
    return json_reply({"object": "list", "data": rows})


async def overrides_create(request: web.Request) -> web.StreamResponse:
    directory = request.app[appkeys.DIRECTORY]
    try:
        record = await directory.create_override(await read_body(request), request.app[appkeys.POLICIES].current)
    except DirectoryError as error:
        return admin_error(error.status, str(error), error.param)
    view = record.view(time.time())
    note(request, target=record.id, after=view)
    return json_reply(view, status=201)


async def overrides_delete(request: web.Request) -> web.StreamResponse:
    override_id = request.match_info["override_id"]
    try:
        record = await request.app[appkeys.DIRECTORY].delete_override(override_id)
    except DirectoryError as error:
        return admin_error(error.status, str(error), error.param)
    note(request, target=override_id, before=record.view(time.time()))
    return json_reply({"id": override_id, "deleted": True})


def override_routes() -> list[tuple[str, str, Handler]]:
    """Admin routes (guarded by the admin token where they are mounted)."""
    return [
        ("GET", "/admin/overrides", overrides_list),
        ("POST", "/admin/overrides", overrides_create),
        ("DELETE", "/admin/overrides/{override_id}", overrides_delete),
    ]
