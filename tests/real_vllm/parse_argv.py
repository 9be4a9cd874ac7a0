"""Run inside the vLLM venv: parse command lines with `vllm serve`'s own argument parser.

Reads {"argvs": [argv, ...], "build_config": [bool, ...]} on stdin (each argv starting with the
executable and `serve`), and writes one JSON object per argv on stdout after "RESULTS ":
{"ok": true, "args": {...}} or {"ok": false, "error": "..."}.
The parser is built the way `vllm`'s main builds it (the serve subcommand's `subparser_init`, then its
`validate`), and the parsed namespace is turned into vLLM's EngineArgs and a full engine config
(`create_engine_config`), which checks the JSON configs (`--kv-events-config`, `--kv-transfer-config`)
against their dataclasses and the model directory's config.json. No server starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _parser() -> tuple[argparse.ArgumentParser, Any]:
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    (command,) = serve.cmd_init()
    command.subparser_init(subparsers)
    return parser, command


def check(argv: list[str], build_config: bool) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser, command = _parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exc:  # argparse reports errors by exiting
        return {"ok": False, "error": f"argparse exit {exc.code}"}
    if getattr(args, "model_tag", None) is not None:  # as `vllm serve`'s cmd does: the positional wins
        args.model = args.model_tag
    try:
        command.validate(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        if build_config:
            engine_args.create_engine_config()
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    parsed = {k: v for k, v in vars(args).items() if not callable(v)}
    return {"ok": True, "args": json.loads(json.dumps(parsed, default=str))}


def main() -> None:
    request = json.load(sys.stdin)
    builds = request.get("build_config") or [True] * len(request["argvs"])
    results = [check(argv, bool(build)) for argv, build in zip(request["argvs"], builds, strict=True)]
    sys.stdout.write("\n" + "RESULTS " + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
