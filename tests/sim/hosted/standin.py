"""Starting a hosted-provider stand-in (`python -m sim.hosted PROVIDER`) as a real process, for tests.

A subprocess rather than an in-process aiohttp server: the official SDKs checked against the stand-ins
are synchronous clients (they would block a test's event loop serving the stand-in), and the runner
the benchmark and the gateway's end-to-end tests start is exercised too. `spawn` registers the process
so that it is ended whatever the test does; the context manager stops it on exit, failure included.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from backends.hosted.base import ProviderCodec, ProviderError, ProviderStreamError, ProviderTarget, ProviderUsage
from tests.support.procs import REPO, free_port, spawn, stop_process, wait_http


@dataclass(frozen=True, slots=True)
class StandIn:
    url: str
    log: Path

    def usage(self) -> dict[str, object]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/standin/usage", timeout=5) as response:
            data: dict[str, object] = orjson.loads(response.read())
        return data

    def fault(self, status: int, count: int = 1) -> None:
        import urllib.request

        body = orjson.dumps({"status": status, "count": count})
        request = urllib.request.Request(self.url + "/standin/faults", data=body, method="POST")
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=5):
            pass


@contextlib.contextmanager
def standin(provider: str, *flags: str) -> Iterator[StandIn]:
    """A running stand-in for `provider` with extra command-line `flags`; stopped on exit."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_dir = Path(tempfile.mkdtemp(prefix=f"standin-{provider}-"))
    log = log_dir / "standin.log"
    argv = [sys.executable, "-m", "sim.hosted", provider, "--port", str(port), *flags]
    with open(log, "wb") as out:
        proc = spawn(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/standin/health", timeout_s=30, proc=proc)
        except Exception as exc:
            raise RuntimeError(f"{provider} stand-in did not start ({exc}):\n{log.read_text()[-2000:]}") from None
        yield StandIn(url, log)
    finally:
        stop_process(proc)


@dataclass(slots=True)
class Exchange:
    """One codec call through a stand-in: the HTTP status and headers, and what the codec read back."""

    status: int
    headers: dict[str, str]
    completion: dict[str, Any] | None = None  # non-streamed answers
    chunks: list[dict[str, Any]] = field(default_factory=list)  # streamed answers
    usage: ProviderUsage | None = None
    error: ProviderError | None = None  # a non-2xx answer, or a stream's error


async def exchange(
    url: str, codec: ProviderCodec, chat: Mapping[str, Any], target: ProviderTarget, auth: Mapping[str, str]
) -> Exchange:
    """codec.request → HTTP (aiohttp) → stand-in → codec.answer / codec.stream / codec.error."""
    call = codec.request(chat, target)
    headers = {**dict(call.headers), **auth}
    async with (
        aiohttp.ClientSession() as http,
        http.request(call.method, url + call.path, data=call.body, headers=headers) as response,
    ):
        result = Exchange(response.status, {k.lower(): v for k, v in response.headers.items()})
        if response.status >= 300:
            result.error = codec.error(response.status, result.headers, await response.read())
            return result
        if not call.stream:
            result.completion, result.usage = codec.answer(await response.read(), target)
            return result
        decoder = codec.stream(target)
        try:
            async for data in response.content.iter_any():
                result.chunks.extend(decoder.feed(data))
            result.chunks.extend(decoder.close())
        except ProviderStreamError as failed:
            result.error = failed.error
        result.usage = decoder.usage
        return result
