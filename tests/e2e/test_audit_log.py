"""The audit log of admin changes against a real gateway process: a key created, its limit changed
and the key revoked through the admin API are read back from `GET /admin/audit` with their actor,
before and after (and never the secret); then the gateway is killed with SIGKILL, started again on
the same directory, and every record is still there, and new ones follow them."""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import Gateway, SimEngines, policies_doc, start_gateway, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA = "llama-3.1-8b"
TOKEN = "audit-test-admin-token-0123"


def admin(gateway: Gateway, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(gateway.url + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_admin_changes_are_recorded_readable_and_survive_kill_9(
    sim_factory: Callable[..., SimEngines], tmp_path: Path
) -> None:
    engines = sim_factory(count=1, time_scale=50, served_model_name=LLAMA)
    workdir = tmp_path / "gw"

    def start() -> Gateway:
        return start_gateway(
            workdir, pools=[static_pool("p", LLAMA, engines.urls)], policies=policies_doc(),
            server={"admin_token": TOKEN},
        )  # fmt: skip

    gateway = start()
    try:
        status, made = admin(gateway, "POST", "/admin/keys", {"tenant": "t1", "id": "audited", "limits": {"rpm": 5}})
        assert status == 201
        secret = made["secret"]
        assert admin(gateway, "PATCH", "/admin/keys/audited", {"limits": {"rpm": 50}})[0] == 200
        assert admin(gateway, "DELETE", "/admin/keys/audited")[0] == 200
        assert admin(gateway, "PATCH", "/admin/keys/no-such-key", {"limits": {"rpm": 1}})[0] == 404  # no change
        assert admin(gateway, "GET", "/admin/keys")[0] == 200  # a read

        status, body = admin(gateway, "GET", "/admin/audit")
        assert status == 200 and body["enabled"]
        rows = body["data"]
        assert secret not in json.dumps(body)
        assert [(r["action"], r["target"], r["status"]) for r in rows] == [
            ("DELETE /admin/keys/{key_id}", "audited", 200),
            ("PATCH /admin/keys/{key_id}", "audited", 200),
            ("POST /admin/keys", "audited", 201),
        ]
        revoke, patch, create = rows
        assert {r["actor"] for r in rows} == {"admin-token"} and {r["client"] for r in rows} == {"127.0.0.1"}
        assert create["before"] is None and create["after"]["limits"] == {"rpm": 5}
        assert patch["before"]["limits"] == {"rpm": 5} and patch["after"]["limits"] == {"rpm": 50}
        assert revoke["before"]["status"] == "active" and revoke["after"]["status"] == "revoked"
        assert revoke["ts"] >= patch["ts"] >= create["ts"] and create["time"].endswith("Z")
        assert [r["target"] for r in admin(gateway, "GET", "/admin/audit?action=PATCH")[1]["data"]] == ["audited"]
        assert admin(gateway, "GET", "/admin/audit?limit=1")[1]["has_more"] is True

        gateway.stop(signal.SIGKILL)  # no shutdown, no flush: only what was fsync'd is left
        lines = [json.loads(line) for path in (workdir / "var" / "audit").glob("audit.jsonl*") for line in path.open()]
        assert sorted(r["ts"] for r in lines) == sorted(r["ts"] for r in rows)

        gateway = start()
        assert admin(gateway, "GET", "/admin/audit")[1]["data"] == rows
        assert admin(gateway, "POST", "/admin/tenants", {"name": "after-restart"})[0] == 201
        again = admin(gateway, "GET", "/admin/audit")[1]["data"]
        assert [r["target"] for r in again] == ["after-restart", "audited", "audited", "audited"]
        assert again[1:] == rows
    finally:
        gateway.stop()
