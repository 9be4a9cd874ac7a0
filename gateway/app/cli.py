"""The `tokenway` command: serve, sim, keys, tenants, users, policies, pools, usage.

One parser for every subcommand; the heavy ones (the server, the simulator, the usage report) are
imported when their subcommand runs.

## `tokenway keys …` and `tokenway tenants …`

The admin API of a running gateway from the shell. Every command is one call to `/admin/keys` or
`/admin/tenants` (`--url`, `--admin-token` or $TOKENWAY_ADMIN_TOKEN), so the gateway validates,
stores and applies it on every replica exactly as for the console. `keys create --yaml` works
offline instead: it prints a key and the entry to paste under `keys:` in policies.yaml (for keys
managed in git).

## `tokenway users token NAME`

A fresh API token for an operator of `server.users`, printed once with the gateway.yaml entry that
holds only its SHA-256 (docs/security.md#roles-and-user-tokens).

Offline on purpose: users live in gateway.yaml (reviewed, versioned, one file for every replica), so
minting a token changes nothing until the entry is added and the gateway restarted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import yaml

from gateway.app.settings import ConfigError, load_settings


def _serve(args: argparse.Namespace) -> int:
    from gateway.app.server import run

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return 2
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v is not None}
    if updates:
        settings = settings.model_copy(update={"server": settings.server.model_copy(update=updates)})
    from gateway.workers.plan import worker_count

    workers = worker_count(settings.server.workers)
    if workers > 1:  # a group of processes on one port (gateway/workers)
        from gateway.workers.group import run_group

        return run_group(settings, workers, log_level=args.log_level)
    return run(settings)


def _workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of processes or auto (got {value!r})") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"at least 1 (got {count})")
    return count


def _epp(args: argparse.Namespace) -> int:
    try:
        from gateway.epp.app import create_epp_app
    except ImportError as exc:
        print(f"tokenway: the endpoint picker needs grpcio and Envoy's types: {exc}", file=sys.stderr)
        return 2
    from gateway.app.server import run

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return 2
    updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if updates:
        settings = settings.model_copy(update={"server": settings.server.model_copy(update=updates)})
    if args.grpc_port is not None:
        settings = settings.model_copy(update={"epp": settings.epp.model_copy(update={"port": args.grpc_port})})
    return run(settings, app_factory=create_epp_app)


def _policies_check(args: argparse.Namespace) -> int:
    from policies.loader import check_file

    problems = check_file(args.file)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.file}: ok")
    return 1 if problems else 0


def _check(args: argparse.Namespace) -> int:
    from gateway.app.checks import check_files

    unset: list[str] = []
    findings = check_files(args.config, probe=not args.no_probe, unset=unset if args.allow_unset else None)
    for finding in findings:
        print(finding, file=sys.stderr if finding.severity == "error" else sys.stdout)
    errors = sum(1 for f in findings if f.severity == "error")
    warnings = len(findings) - errors
    if not findings:
        print(f"{args.config}: ok")
    else:
        print(f"{args.config}: {errors} error(s), {warnings} warning(s)")
    return 1 if errors or (args.strict and warnings) else 0


def _pools_plan(args: argparse.Namespace) -> int:
    """The launch plan of one or more gateway.yaml files; unset ${VAR}s stay as placeholders."""
    from backends.plan import render_plan
    from backends.types import PlanError

    paths = [*(args.config or []), *args.files] or ["config/gateway.yaml"]
    status = 0
    for n, path in enumerate(paths):
        unset: list[str] = []
        if len(paths) > 1:
            print(("\n" if n else "") + f"# === {path}")
        try:
            settings = load_settings(path, unset)
            for item in unset:
                where, _, name = item.partition(": ")
                print(
                    f"warning: {path}: {where}: environment variable {name} is not set; shown as ${{{name}}}",
                    file=sys.stderr,
                )
            print(render_plan(list(settings.pools), settings.backends))
        except (ConfigError, PlanError) as exc:
            print(f"tokenway: {exc}", file=sys.stderr)
            status = 2
    return status


def _pools_status(args: argparse.Namespace) -> int:
    """`GET /admin/backends` (and `/admin/pools`) through the same client as `keys` and `tenants`:
    `$TOKENWAY_URL`, and a refused token reported as such, not as an unreachable gateway."""
    import json

    from backends.scrape import format_status
    from gateway.autoscale.admin import format_pools

    try:
        status = admin_call(args, "GET", "/admin/backends")
    except AdminError as exc:
        print(f"tokenway: {exc}", file=sys.stderr)
        return 1
    autoscale: dict[str, Any] = {}
    try:
        autoscale = admin_call(args, "GET", "/admin/pools")
    except AdminError:
        autoscale = {}  # an older gateway without /admin/pools
    if autoscale.get("pools"):
        status["autoscale"] = autoscale
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
        if autoscale.get("pools"):
            print(format_pools(autoscale))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenway", description="Token-aware LLM API gateway.")
    parser.add_argument("--log-level", default=os.environ.get("TOKENWAY_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", default="config/gateway.yaml")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--workers",
        type=_workers_arg,
        help="gateway processes on the port, sharing state (default server.workers, 1; auto: one per core)",
    )
    serve.set_defaults(func=_serve)

    epp = sub.add_parser("epp", help="serve as a Gateway API Inference Extension endpoint picker (Envoy ext_proc)")
    epp.add_argument("--config", default="config/gateway.yaml")
    epp.add_argument("--host", help="the HTTP port's host (health, metrics, admin)")
    epp.add_argument("--port", type=int, help="the HTTP port")
    epp.add_argument("--grpc-port", type=int, help="the ext_proc gRPC port (default epp.port, 9002)")
    epp.set_defaults(func=_epp)

    sim = sub.add_parser("sim", help="run simulated vLLM-compatible engines", add_help=False)
    sim.set_defaults(func=None)

    add_key_parsers(sub)
    add_user_parsers(sub)

    check = sub.add_parser("check", help="validate gateway.yaml with its policies.yaml; print every problem")
    check.add_argument("--config", default="config/gateway.yaml")
    check.add_argument("--no-probe", action="store_true", help="do not connect to static endpoints")
    check.add_argument("--strict", action="store_true", help="warnings fail the check too")
    check.add_argument("--allow-unset", action="store_true", help="unset ${VAR}s are warnings (CI without secrets)")
    check.set_defaults(func=_check)

    policies = sub.add_parser("policies", help="policies.yaml").add_subparsers(dest="policies_command", required=True)
    check = policies.add_parser("check", help="validate a policies file; print every problem")
    check.add_argument("file")
    check.set_defaults(func=_policies_check)

    pools = sub.add_parser("pools", help="engine pools").add_subparsers(dest="pools_command", required=True)
    plan = pools.add_parser("plan", help="print every replica's command line and environment; launch nothing")
    plan.add_argument("files", nargs="*", help="gateway.yaml files (also --config, repeatable)")
    plan.add_argument("--config", action="append", help="a gateway.yaml (default config/gateway.yaml)")
    plan.set_defaults(func=_pools_plan)
    status = pools.add_parser("status", help="pools, endpoints, state, load of a running gateway")
    status.add_argument("--url", default=default_url(), help="the gateway (default $TOKENWAY_URL, else 127.0.0.1:8080)")
    status.add_argument("--admin-token", default=os.environ.get("TOKENWAY_ADMIN_TOKEN"))
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_pools_status)
    from gateway.ledger.cli import add_usage_parser

    add_usage_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":  # the engine has its own vLLM-style flag parser
        from sim.server import main as sim_main

        return sim_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        return _closed_pipe()
    return code


def _closed_pipe() -> int:
    """The reader of our stdout went away (`tokenway pools status | head`): stop quietly, as `cat` does.

    stdout is pointed at /dev/null so the interpreter's own flush at exit cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


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


def add_key_parsers(sub: Any) -> None:
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


TOKEN_PREFIX = "twu-"  # tells a user token from an API key (tw-) in a log or a secret store


def mint() -> tuple[str, str]:
    """A new token (256 random bits) and its SHA-256 hex digest."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode("utf-8")).hexdigest()


def users_token(args: argparse.Namespace) -> int:
    token, digest = mint()
    entry: dict[str, Any] = {"name": args.name, "role": args.role}
    if args.teams:
        entry["teams"] = [t.strip() for t in args.teams.split(",") if t.strip()]
    entry["tokens_sha256"] = [digest]
    print(f"token (shown once; give it to {args.name}): {token}")
    print("gateway.yaml, under server.users (or add the digest to an existing user's tokens_sha256):")
    print(yaml.safe_dump([entry], sort_keys=False).rstrip())
    return 0


def add_user_parsers(sub: Any) -> None:
    users = sub.add_parser("users", help="operators with roles (server.users)")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    token = users_sub.add_parser("token", help="a new API token for a user: prints it once and its YAML entry")
    token.add_argument("name")
    token.add_argument("--role", choices=["admin", "team_admin", "viewer"], default="viewer")
    token.add_argument("--teams", help="comma-separated teams of a team_admin")
    token.set_defaults(func=users_token)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
