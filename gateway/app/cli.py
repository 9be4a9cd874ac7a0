"""The `tokenway` command: serve, sim, keys, policies, pools, usage."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

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

    from backends.status import format_status
    from gateway.app.cli_keys import AdminError, admin_call
    from gateway.autoscale.status import format_pools

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

    from gateway.app.cli_keys import add_parsers as add_key_parsers

    add_key_parsers(sub)
    from gateway.app.cli_users import add_parsers as add_user_parsers

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
    from gateway.app.cli_keys import default_url

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
        from sim.cli import main as sim_main

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
