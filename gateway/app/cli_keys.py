"""`tokenway keys …` and `tokenway tenants …`: the admin API of a running gateway from the shell.

Every command is one call to `/admin/keys` or `/admin/tenants` (`--url`, `--admin-token` or
$TOKENWAY_ADMIN_TOKEN), so the gateway validates, stores and applies it on every replica exactly as
for the console. `keys create --yaml` works offline instead: it prints a key and the entry to paste
under `keys:` in policies.yaml (for keys managed in git).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

LIMIT_FLAGS = ("rpm", "rpd", "tpm", "tpd", "max_concurrent", "usd_per_day", "usd_per_month")


class AdminError(Exception):
    """An admin API call the gateway refused or could not be reached for; the CLI prints it and exits 1."""


DEFAULT_URL = "http://127.0.0.1:8080"
AUTH_HINT = "the admin token was refused or missing: pass --admin-token or set $TOKENWAY_ADMIN_TOKEN"


def default_url() -> str:
    """The gateway every admin command talks to unless `--url` says otherwise: $TOKENWAY_URL."""
    return os.environ.get("TOKENWAY_URL") or DEFAULT_URL


def admin_call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One admin API call; raises AdminError with the gateway's message (or why it was unreachable)."""
    headers = {"Content-Type": "application/json"}
    if args.admin_token:
        headers["Authorization"] = f"Bearer {args.admin_token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        hint = f" ({AUTH_HINT})" if exc.code in (401, 403) else ""  # reached, but refused: not "cannot reach"
        raise AdminError(f"{method} {path}: {exc.code} {message}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach {args.url}: {getattr(exc, 'reason', exc)}") from None


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name, None) is not None}


def _metadata(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ("owner", "team", "description") if getattr(args, name, None)}


def _models(text: str | None) -> list[str] | None:
    return None if text is None else [m.strip() for m in text.split(",") if m.strip()]


def _expiry(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    return (
        {"expires_in": text} if text[-1:] in "smhdw" and text[:-1].replace(".", "").isdigit() else {"expires_at": text}
    )


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


# ---------------------------------------------------------------------- keys
def keys_create(args: argparse.Namespace) -> int:
    if args.yaml:
        return _keys_create_yaml(args)
    body: dict[str, Any] = {"tenant": args.tenant, "limits": _limits(args), "metadata": _metadata(args)}
    if args.id:
        body["id"] = args.id
    if args.models:
        body["models"] = _models(args.models)
    if args.priority:
        body["priority"] = args.priority
    body.update(_expiry(args.expires))
    found = admin_call(args, "POST", "/admin/keys", body)
    if args.json:
        _print(found)
        return 0
    key = found["key"]
    print(f"API key (shown once, store it now): {found['secret']}")
    print(
        f"id {key['id']}, tenant {key['tenant']}" + (f", expires {key['expires_at']}" if key.get("expires_at") else "")
    )
    return 0


def _keys_create_yaml(args: argparse.Namespace) -> int:
    from policies.policy import hash_key

    key = "tw-" + secrets.token_urlsafe(32)
    key_id = args.id or f"{args.tenant}-{secrets.token_hex(3)}"
    print(f"API key (shown once, store it now): {key}")
    print("\nPaste under `keys:` in policies.yaml:\n")
    print(f"  - id: {key_id}")
    print(f"    tenant: {args.tenant}")
    print(f"    sha256: {hash_key(key)}")
    models = _models(args.models)
    if models:
        print(f"    models: [{', '.join(models)}]")
    return 0


def keys_list(args: argparse.Namespace) -> int:
    query = {k: v for k, v in (("tenant", args.tenant), ("include_revoked", "1" if args.all else None)) if v}
    path = "/admin/keys" + ("?" + urllib.parse.urlencode(query) if query else "")
    found = admin_call(args, "GET", path)
    if args.json:
        _print(found)
        return 0
    rows = [("id", "tenant", "source", "status", "models", "limits", "last_used_at", "owner")]
    for key in found.get("data", []):
        limits = ",".join(f"{k}={v:g}" for k, v in (key.get("limits") or {}).items())
        rows.append(
            (
                key["id"],
                key["tenant"],
                key.get("source", ""),
                key.get("status", ""),
                ",".join(key.get("models") or []) or "*",
                limits or "-",
                key.get("last_used_at") or "-",
                (key.get("metadata") or {}).get("owner") or "-",
            )
        )
    _table(rows)
    return 0


def keys_show(args: argparse.Namespace) -> int:
    _print(admin_call(args, "GET", f"/admin/keys/{urllib.parse.quote(args.id)}"))
    return 0


def _shared_changes(args: argparse.Namespace) -> dict[str, Any]:
    """What `keys update` and `tenants update` both change: limits (set or cleared), models, priority."""
    body: dict[str, Any] = {}
    if _limits(args):
        body["limits"] = _limits(args)
    for name in args.clear or []:
        body.setdefault("limits", {})[name] = None
    if args.models is not None:
        body["models"] = _models(args.models) or None
    if args.priority:
        body["priority"] = args.priority
    return body


def keys_update(args: argparse.Namespace) -> int:
    body = _shared_changes(args)
    if _metadata(args):
        body["metadata"] = _metadata(args)
    body.update(_expiry(args.expires))
    if not body:
        print("tokenway: nothing to change (give limits, --models, --priority, --expires or metadata)", file=sys.stderr)
        return 2
    _print(admin_call(args, "PATCH", f"/admin/keys/{urllib.parse.quote(args.id)}", body))
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    admin_call(args, "DELETE", f"/admin/keys/{urllib.parse.quote(args.id)}")
    print(f"key {args.id} revoked")
    return 0


def keys_rotate(args: argparse.Namespace) -> int:
    found = admin_call(args, "POST", f"/admin/keys/{urllib.parse.quote(args.id)}/rotate", {"grace_s": args.grace_s})
    print(f"new API key (shown once, store it now): {found['secret']}")
    valid = found["key"].get("previous_secrets_valid_until") or []
    print(f"the previous secret stays valid until {valid[-1]}" if valid else "the previous secret no longer works")
    return 0


# ---------------------------------------------------------------------- tenants
def tenants_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "limits": _limits(args), "metadata": _metadata(args)}
    if args.models:
        body["models"] = _models(args.models)
    if args.priority:
        body["priority"] = args.priority
    if args.slo_class:
        body["slo_class"] = args.slo_class
    if args.no_fallback:
        body["allow_fallback"] = False
    _print(admin_call(args, "POST", "/admin/tenants", body))
    return 0


def tenants_list(args: argparse.Namespace) -> int:
    found = admin_call(args, "GET", "/admin/tenants")
    if args.json:
        _print(found)
        return 0
    rows = [("name", "source", "priority", "models", "limits")]
    for tenant in found.get("data", []):
        limits = ",".join(f"{k}={v:g}" for k, v in (tenant.get("limits") or {}).items())
        rows.append(
            (
                tenant["name"],
                tenant["source"],
                tenant["priority"],
                ",".join(tenant.get("models") or []) or "*",
                limits or "-",
            )
        )
    _table(rows)
    return 0


def tenants_show(args: argparse.Namespace) -> int:
    _print(admin_call(args, "GET", f"/admin/tenants/{urllib.parse.quote(args.name)}"))
    return 0


def tenants_update(args: argparse.Namespace) -> int:
    body = _shared_changes(args)
    if args.slo_class:
        body["slo_class"] = args.slo_class
    _print(admin_call(args, "PATCH", f"/admin/tenants/{urllib.parse.quote(args.name)}", body))
    return 0


def tenants_delete(args: argparse.Namespace) -> int:
    admin_call(args, "DELETE", f"/admin/tenants/{urllib.parse.quote(args.name)}")
    print(f"tenant {args.name} deleted")
    return 0


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


# ---------------------------------------------------------------------- parsers
def _connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=default_url(), help="the gateway (default $TOKENWAY_URL, else 127.0.0.1:8080)")
    parser.add_argument("--admin-token", default=os.environ.get("TOKENWAY_ADMIN_TOKEN"))
    parser.add_argument("--json", action="store_true", help="print the API's JSON")


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    for name in LIMIT_FLAGS:
        kind = float if name.startswith("usd") else int
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind)


def _metadata_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--owner")
    parser.add_argument("--team")
    parser.add_argument("--description")


def run(handler: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except AdminError as exc:
            print(f"tokenway: {exc}", file=sys.stderr)
            return 1

    return wrapped


def add_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys (through a running gateway's admin API)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="make a key; prints its secret once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--models", help="comma-separated allowed models (default: the tenant's)")
    create.add_argument("--id", help="key id (default: <tenant>-<random>)")
    create.add_argument("--priority", choices=["critical", "high", "normal", "low", "sheddable"])
    create.add_argument("--expires", help="a duration (30d, 12h) or an ISO time")
    create.add_argument("--yaml", action="store_true", help="offline: print the policies.yaml entry instead")
    _limit_flags(create)
    _metadata_flags(create)
    _connection(create)
    create.set_defaults(func=run(keys_create))
    listing = keys_sub.add_parser("list", help="keys (file and API), never secrets")
    listing.add_argument("--tenant")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    _connection(listing)
    listing.set_defaults(func=run(keys_list))
    show = keys_sub.add_parser("show", help="one key with its limits' standing and spend")
    show.add_argument("id")
    _connection(show)
    show.set_defaults(func=run(keys_show))
    update = keys_sub.add_parser("update", help="change a key's limits, models, priority, expiry or metadata")
    update.add_argument("id")
    update.add_argument("--models", help="comma-separated; empty string: the tenant's")
    update.add_argument("--priority", choices=["critical", "high", "normal", "low", "sheddable"])
    update.add_argument("--expires")
    update.add_argument("--clear", action="append", choices=LIMIT_FLAGS, help="remove one of the key's own limits")
    _limit_flags(update)
    _metadata_flags(update)
    _connection(update)
    update.set_defaults(func=run(keys_update))
    revoke = keys_sub.add_parser("revoke", help="revoke a key (on every replica within a second)")
    revoke.add_argument("id")
    _connection(revoke)
    revoke.set_defaults(func=run(keys_revoke))
    rotate = keys_sub.add_parser("rotate", help="a new secret; the old one stays valid for --grace-s")
    rotate.add_argument("id")
    rotate.add_argument("--grace-s", type=float, default=3600.0)
    _connection(rotate)
    rotate.set_defaults(func=run(keys_rotate))

    tenants = sub.add_parser("tenants", help="tenants (through a running gateway's admin API)")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True)
    t_create = tenants_sub.add_parser("create", help="make a tenant")
    t_create.add_argument("name")
    t_create.add_argument("--models")
    t_create.add_argument("--priority", choices=["critical", "high", "normal", "low", "sheddable"])
    t_create.add_argument("--slo-class")
    t_create.add_argument("--no-fallback", action="store_true")
    _limit_flags(t_create)
    _metadata_flags(t_create)
    _connection(t_create)
    t_create.set_defaults(func=run(tenants_create))
    t_list = tenants_sub.add_parser("list")
    _connection(t_list)
    t_list.set_defaults(func=run(tenants_list))
    t_show = tenants_sub.add_parser("show")
    t_show.add_argument("name")
    _connection(t_show)
    t_show.set_defaults(func=run(tenants_show))
    t_update = tenants_sub.add_parser("update")
    t_update.add_argument("name")
    t_update.add_argument("--models")
    t_update.add_argument("--priority", choices=["critical", "high", "normal", "low", "sheddable"])
    t_update.add_argument("--slo-class")
    t_update.add_argument("--clear", action="append", choices=LIMIT_FLAGS)
    _limit_flags(t_update)
    _connection(t_update)
    t_update.set_defaults(func=run(tenants_update))
    t_delete = tenants_sub.add_parser("delete", help="delete a tenant that has no live keys")
    t_delete.add_argument("name")
    _connection(t_delete)
    t_delete.set_defaults(func=run(tenants_delete))
