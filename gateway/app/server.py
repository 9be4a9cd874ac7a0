"""Running the gateway process: the uvloop loop, the listening socket, signals and graceful drain.

Kept apart from the app factory (as aiohttp keeps `web_runner` apart from `web_app`) so tests and
benchmarks can build the app without a process around it.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from backends.types import PlanError
from gateway.app import keys as appkeys
from gateway.app.factory import create_app
from gateway.app.settings import ConfigError, GatewaySettings
from gateway.http.access import exposure_problem
from gateway.http.connections import GatewayRunner
from policies.loader import PolicyFileError

log = logging.getLogger("tokenway.server")
READY_WAIT_POLLS = 150  # the ready banner waits up to 30 s (0.2 s polls) for static pools' first probe


def make_runner(app: web.Application, settings: GatewaySettings) -> web.AppRunner:
    server = settings.server
    return GatewayRunner(  # answers clients that half-close (gateway/http/connections.py)
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler: upstream closes at once
        access_log=None,
        shutdown_timeout=server.drain_timeout_s,
        keepalive_timeout=server.request_read_timeout_s,  # also cuts off connections that never finish a request
        max_line_size=server.max_header_bytes,
        max_field_size=server.max_header_bytes,
    )


AppFactory = Callable[[GatewaySettings], web.Application]


async def serve(
    settings: GatewaySettings, *, banner: bool = True, app_factory: AppFactory = create_app, reuse_port: bool = False
) -> int:
    """Serve until SIGTERM/SIGINT, then stop accepting, drain in-flight requests, stop engines.

    `reuse_port`: one of several workers on the same port (gateway/workers), each its own socket. A
    worker binds only once its app has started: the kernel hands a share of new connections to every
    socket of the group, and one whose process is still starting would hold them unanswered (the
    group's parent checked the port before anything started)."""
    problem = exposure_problem(settings.server.host, settings.server.admin_token)
    if problem is not None:  # checked before anything starts (engines included)
        print(f"tokenway: {problem}", file=sys.stderr, flush=True)
        return 2
    raise_open_files_limit()
    sock: socket.socket | None = None
    if not reuse_port:  # the port first: nothing (no engine) starts when it is taken
        sock = _listen_or_say(settings)
        if sock is None:
            return 2
    app = app_factory(settings)
    runner = make_runner(app, settings)
    try:
        await runner.setup()
    except (PolicyFileError, PlanError, ConfigError) as exc:  # a bad file stops start-up with its message
        print(f"tokenway: {exc}", file=sys.stderr, flush=True)
        if sock is not None:
            sock.close()
        await runner.cleanup()
        return 2
    if sock is None:
        sock = _listen_or_say(settings, reuse_port=True)
        if sock is None:
            await runner.cleanup()
            return 2
    site = web.SockSite(runner, sock)
    await site.start()
    if settings.server.gc_young_threshold:
        tune_gc(settings.server.gc_young_threshold)
    host, port = runner.addresses[0][:2]
    if banner:
        print_banner(app, host, port)
    ready_note = asyncio.get_running_loop().create_task(_announce_ready(app)) if banner else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining in-flight requests for up to %.0fs", settings.server.drain_timeout_s)
    if ready_note is not None:
        ready_note.cancel()
    await runner.cleanup()
    return 0


def _listen_or_say(settings: GatewaySettings, *, reuse_port: bool = False) -> socket.socket | None:
    """The listening socket, or None after telling the operator why it cannot be opened."""
    host, port = settings.server.host, settings.server.port
    try:
        return listen_socket(host, port, reuse_port=reuse_port)
    except OSError as exc:
        print(f"tokenway: {port_problem(host, port, exc)}", file=sys.stderr, flush=True)
        return None


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The listening socket, bound before anything else starts (raises OSError when it cannot be).
    With `reuse_port` the kernel spreads new connections over every socket bound so (SO_REUSEPORT,
    the same user only): how a group of workers shares one port without a balancer in front."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def port_problem(host: str, port: int, exc: OSError) -> str:
    """What to tell an operator whose port cannot be opened, and how to pick another."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another tokenway or server is listening there).\n"
            f"  pick another: tokenway serve --port {port + 1}   or   make run PORT={port + 1}"
        )
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {host}:{port} (ports below 1024 need privileges); try --port 8080"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


BANNER_LINKS = (("/", "about"), ("/ui", "console"), ("/metrics", "metrics"), ("/openapi.json", "API"))
DEMO_KEY = "tw-demo-key-0000"  # config/policies.yaml's demo key (only its digest is in the file)


def print_banner(app: web.Application, host: str, port: int) -> None:
    """Where the gateway listens and a curl that works as pasted: with the demo key when the running
    policy accepts it, else reading the key from $TOKENWAY_KEY (double quotes, so the shell expands it)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)
    root = f"http://{shown}:{port}"
    base = f"{root}/v1"
    print(f"tokenway listening on {base}", flush=True)
    for path, what in BANNER_LINKS:  # the landing page's links (gateway/http/routes.py)
        print(f"  {what + ':':<9} {root}{path}", flush=True)
    pools = app[appkeys.FLEET].pools
    model = next(iter(pools.values())).config.model if pools else "MODEL"
    policy = app[appkeys.POLICIES].current
    key = DEMO_KEY if policy.authenticate(DEMO_KEY) is not None else "$TOKENWAY_KEY"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}'
    print(
        f'  try: curl -s {base}/chat/completions -H "Authorization: Bearer {key}" '
        f"-H 'Content-Type: application/json' -d '{body}'",
        flush=True,
    )
    if key != DEMO_KEY:
        print("       (export TOKENWAY_KEY=<an API key>; `tokenway keys create` makes one)", flush=True)


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one (as Go's runtime does): each client
    connection, engine connection and ledger file takes a descriptor, and the usual soft default
    (1,024) runs out near a thousand connections while the hard limit allows far more. Out of
    descriptors, connections the loop cannot accept are closed at once and engines cannot be
    reached. Returns the soft limit in force (0 where the platform has none)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, _MOST_OPEN_FILES)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:  # a hard limit above the kernel's nr_open
        log.warning("cannot raise the open files limit from %d to %d: %s", soft, wanted, exc)
        return soft
    return wanted


_MOST_OPEN_FILES = 1 << 20  # the target where the hard limit is unlimited (Linux's default nr_open)


def tune_gc(young_threshold: int) -> None:
    """Start-up objects (settings, policies, tokenizer tables, models) live as long as the process:
    freeze them out of the collector's scans. A request allocates a few hundred short-lived objects
    and almost no cycles, so the default young-generation threshold (700) runs a collection every
    couple of requests; a higher one runs it every few dozen, and cyclic garbage stays bounded."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, young_threshold), middle, old)


async def _announce_ready(app: web.Application) -> None:
    """Say when every launched replica is ready (or which failed): engines can take minutes."""
    supervisor = app[appkeys.SUPERVISOR]
    try:
        failures = await supervisor.wait_ready()
    except TimeoutError as exc:
        print(f"tokenway: {exc}", flush=True)
        return
    for failure in failures:
        print(f"tokenway: replica failed: {failure}", flush=True)
    pools = app[appkeys.FLEET].pools
    for _ in range(READY_WAIT_POLLS):  # static endpoints turn ready on their first health probe
        if all(pool.has_ready for pool in pools.values()):
            break
        await asyncio.sleep(0.2)
    ready = sorted(name for name, pool in pools.items() if pool.has_ready)
    waiting = sorted(set(pools) - set(ready))
    note = f"; not ready yet: {', '.join(waiting)} (see /readyz)" if waiting else ""
    print(f"tokenway ready: pools {', '.join(ready) or '(none)'} serving{note}", flush=True)


def run(
    settings: GatewaySettings, app_factory: AppFactory = create_app, *, reuse_port: bool = False, banner: bool = True
) -> int:
    main = serve(settings, app_factory=app_factory, reuse_port=reuse_port, banner=banner)
    return run_loop(main)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` on uvloop (asyncio's own loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.run(main)
    if sys.version_info >= (3, 12):
        return uvloop.run(main)
    uvloop.install()
    return asyncio.run(main)
