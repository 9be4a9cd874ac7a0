"""`python -m sim.hosted PROVIDER --port N [--ttft-ms --tpot-ms --rpm --tpm --fail-after-tokens --seed --api-key]`.

`PROVIDERS` maps a provider name to "module:function"; the function takes a `StandinConfig` and
returns the aiohttp application (imported only when chosen, so one stand-in's optional libraries
are not needed by another). On start the runner prints one line, `listening on http://HOST:PORT`,
so that `--port 0` works for callers that read it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from sim.hosted.common import StandinConfig, add_common_args, config_from_args

PROVIDERS: dict[str, str] = {
    "anthropic": "sim.hosted.anthropic:build_app",
    "azure": "sim.hosted.azure:build_app",
    "bedrock": "sim.hosted.bedrock:build_app",
    "gemini": "sim.hosted.gemini:build_app",
}


def load(provider: str) -> Callable[[StandinConfig], web.Application]:
    module, _, func = PROVIDERS[provider].partition(":")
    builder: Callable[[StandinConfig], web.Application] = getattr(importlib.import_module(module), func)
    return builder


async def _serve(app: web.Application, cfg: StandinConfig) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = cfg.port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    print(f"listening on http://{cfg.host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.hosted", description=__doc__)
    parser.add_argument("provider", choices=sorted(PROVIDERS))
    add_common_args(parser)
    ns = parser.parse_args(argv)
    cfg = config_from_args(ns)
    app = load(ns.provider)(cfg)
    try:
        asyncio.run(_serve(app, cfg))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
