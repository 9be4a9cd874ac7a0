"""A stand-in for an engine whose worker outlives it (as vLLM's EngineCore does, docs/engines.md).

`python stand_in_forking_engine.py MODEL --host H --port P --kv-events-config JSON [other vLLM flags]`
forks a worker (same process group) that binds the KV-event port named in the config and sleeps;
then the leader answers `/health`. SIGKILL of the leader leaves the worker holding the port. A start
whose worker cannot bind prints vLLM's error and exits 1, as a restart into a busy port would.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time

from aiohttp import web


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-events-config", required=True)
    args, _ = parser.parse_known_args()
    endpoint = json.loads(args.kv_events_config)["endpoint"]
    match = re.search(r":(\d+)$", endpoint)
    assert match, endpoint
    kv_port = int(match.group(1))
    read_end, write_end = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.close(read_end)
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", kv_port))
            sock.listen()
        except OSError as exc:
            os.write(write_end, f"OSError: {exc}".encode())
            os._exit(1)
        os.write(write_end, b"ok")
        os.close(write_end)
        while True:
            time.sleep(3600)
    os.close(write_end)
    status = os.read(read_end, 200).decode()
    if status != "ok":
        print(f"(EngineCore pid={worker}) {status}", flush=True)
        return 1
    print(f"worker {worker} bound {kv_port}", flush=True)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
