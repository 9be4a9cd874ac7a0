"""A stand-in for `trtllm-serve` (no GPU here): newer builds' startup behaviour, from tensorrt_llm/serve/readiness.py.

`python stand_in_trtllm.py MODEL --host H --port P --config FILE [--starting-s S] [other flags]`
listens at once, answers every request 503 with `x-trtllm-server-state: starting` for S seconds,
then `/health` 200 and `/v1/models` with `--served-id` (default: the model directory's
basename). It refuses to start when
the `--config` file is missing, as trtllm-serve would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from aiohttp import web
from aiohttp.typedefs import Handler


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--starting-s", type=float, default=0.5)
    parser.add_argument("--served-id", default=None, help="id in /v1/models (default: model basename)")
    args, _ = parser.parse_known_args()
    if not os.path.exists(args.config):
        print(f"config file not found: {args.config}", flush=True)
        return 2
    with open(args.config) as fh:
        print("config:", fh.read().replace("\n", " | "), flush=True)
    ready_at = time.monotonic() + args.starting_s
    model_id = args.served_id or os.path.basename(args.model.rstrip("/"))
    hits = {"starting": 0}

    @web.middleware
    async def starting(request: web.Request, handler: Handler) -> web.StreamResponse:
        if time.monotonic() < ready_at:
            hits["starting"] += 1
            print(f"answered starting {hits['starting']}", flush=True)
            return web.json_response(
                {"error": {"type": "ServiceUnavailableError", "code": "starting", "message": "starting"}},
                status=503,
                headers={"x-trtllm-server-state": "starting", "retry-after": "1"},
            )
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model_id, "object": "model",
                                                              "owned_by": "tensorrt_llm"}]})  # fmt: skip

    app = web.Application(middlewares=[starting])
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
