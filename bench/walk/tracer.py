"""Trace the walk of single requests through one tree's gateway, in process, and print it as JSON.

It measures when run as a script (`python -m bench.walk` runs it once per tree): the tree it
measures becomes the first entry of `sys.path` (the `--root` argument), and that tree has a `bench`
package of its own, so this file imports nothing from `bench`, only the standard library, aiohttp
and the tree's own packages.

    python bench/walk/tracer.py --root TREE [--max-tokens 16]

What it does: builds the gateway from TREE/config/gateway.yaml (the embedded default: simulated
engine pools launched and supervised by the gateway, in-memory state) the way `tokenway serve` does
(the app factory and the runner of the tree's server module, on a free port of 127.0.0.1), waits for
/readyz, then for each request kind sends one warm-up request and one traced request. The simulated
engines are subprocesses (`python -m sim`, or `python -m backends.sim` in older trees): only the
gateway process is traced.

The window: an aiohttp middleware put in front of the app's own sets a context variable when a traced
request comes in. From then on, until the client has read the last byte and the request's task (and
every task it started) has finished, a `sys.setprofile` function records each call of a function of a
production module (a `.py` file under TREE's gateway, policies, predictor, backends or sim) made in
that context: the request's task and its children, not the gateway's background loops (health probes,
metrics scrapes, flow control's ticks), which run in other tasks. Transport callbacks run outside any
task (the upstream connection's `data_received`); one is counted when it is a method of an object the
request itself called a method of (its upstream connection), never the connections of health probes.

Three figures per request: the production modules touched, the functions touched (distinct code
objects; list, set and dict comprehensions are left out because Python 3.12 inlines them into their
function), and the returns to the same module: the sequence of production modules control is in,
consecutive repeats collapsed, counts a return each time a module comes back after control left it for
another production module (dispatch → relay → dispatch is one return to dispatch; dispatch → aiohttp →
dispatch is none). A coroutine suspended at an await and resumed later passes control up through
every awaiting frame and back down: those passes are not returns (the headline figure), and a second
figure counts them too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dis
import faulthandler
import importlib
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

PACKAGES = ("gateway", "policies", "predictor", "backends", "sim")
INLINED = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})  # PEP 709: no code object of their own in 3.12+
RESUME = dis.opmap["RESUME"]
YIELD_VALUE = dis.opmap["YIELD_VALUE"]
GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
DEMO_KEY = "tw-demo-key-0000"  # config/policies.yaml's demo key (make run prints it)
MODEL = "llama-3.1-8b"
PROMPT = "Write one short sentence about the sea."

_WINDOW: contextvars.ContextVar[int] = contextvars.ContextVar("walk_window", default=0)


def _is_resume(frame: FrameType) -> bool:
    """A coroutine or generator frame going on after a yield or an await (RESUME with a non-zero arg)."""
    code = frame.f_code
    if not code.co_flags & GENERATOR_FLAGS or frame.f_lasti < 0:
        return False
    raw = code.co_code
    return raw[frame.f_lasti] == RESUME and raw[frame.f_lasti + 1] != 0


def _is_yield(frame: FrameType) -> bool:
    """A 'return' event that is a suspension (the frame stopped at a yield or an await)."""
    code = frame.f_code
    if not code.co_flags & GENERATOR_FLAGS or frame.f_lasti < 0:
        return False
    return code.co_code[frame.f_lasti] == YIELD_VALUE


class Returns:
    """The sequence of production modules control is in; counts each module's comebacks."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.seen: set[str] = set()
        self.counts: dict[str, int] = {}

    def enter(self, module: str) -> None:
        if module == self.current:
            return
        if module in self.seen:
            self.counts[module] = self.counts.get(module, 0) + 1
        self.seen.add(module)
        self.current = module


class Walk:
    """What one traced request touched."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.functions: dict[str, set[tuple[str, int]]] = {}
        self.calls: dict[str, int] = {}
        self.callback_modules: set[str] = set()
        self.lazy_imports: set[str] = set()
        self.returns = Returns()  # suspensions and resumptions at awaits left out
        self.returns_awaits = Returns()  # with them
        self._pending: str | None = None  # the innermost frame resumed since the last real call/return
        self._claimed: dict[int, object] = {}  # objects the request called methods of
        self._callback_root: FrameType | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    def _settle(self) -> None:
        if self._pending is not None:
            self.returns.enter(self._pending)
            self._pending = None

    def finish(self) -> None:
        self._settle()

    def event(self, frame: FrameType, event: str, module_of: Callable[[str], str | None]) -> None:
        code = frame.f_code
        module = module_of(code.co_filename)
        if _WINDOW.get() != self.window:
            if asyncio.current_task() is not None:
                return  # another task: a background loop
            if self._callback_root is None:
                if event != "call" or module is None:
                    return
                owner = frame.f_locals.get("self")
                if owner is None or id(owner) not in self._claimed:
                    return
                self._callback_root = frame  # a transport callback on the request's own connection
            if module is not None:
                self.callback_modules.add(module)
            if event == "return" and frame is self._callback_root:
                self._callback_root = None
        if event == "call":
            if module is None:
                return
            self._call(frame, code, module)
        else:
            self._return(frame)

    def _call(self, frame: FrameType, code: CodeType, module: str) -> None:
        if _is_resume(frame):
            self.returns_awaits.enter(module)
            self._pending = module
            return
        self._settle()
        self.returns.enter(module)
        self.returns_awaits.enter(module)
        self.calls[module] = self.calls.get(module, 0) + 1
        name = code.co_qualname
        if name == "<module>":
            self.lazy_imports.add(module)
        elif name not in INLINED:
            self.functions.setdefault(module, set()).add((name, code.co_firstlineno))
        owner = frame.f_locals.get("self")
        if owner is not None and _WINDOW.get() == self.window:
            self._claimed[id(owner)] = owner

    def _return(self, frame: FrameType) -> None:
        suspended = _is_yield(frame)
        if not suspended:
            self._settle()
        back = frame.f_back
        while back is not None:
            module = module_of(back.f_code.co_filename)
            if module is not None:
                self.returns_awaits.enter(module)
                if not suspended:
                    self.returns.enter(module)
                return
            back = back.f_back

    def report(self) -> dict[str, Any]:
        modules = sorted(set(self.functions) | set(self.calls))
        return {
            "modules": {
                m: {
                    "functions": sorted(f"{name}:{line}" for name, line in self.functions.get(m, ())),
                    "calls": self.calls.get(m, 0),
                    "returns": self.returns.counts.get(m, 0),
                    "returns_with_awaits": self.returns_awaits.counts.get(m, 0),
                }
                for m in modules
            },
            "module_count": len(modules),
            "function_count": sum(len(f) for f in self.functions.values()),
            "returns": sum(self.returns.counts.values()),
            "returns_with_awaits": sum(self.returns_awaits.counts.values()),
            "callback_modules": sorted(self.callback_modules),
            "lazy_imports": sorted(self.lazy_imports),
        }


_ROOT = Path(".")
_CACHE: dict[str, str | None] = {}


def module_of(filename: str) -> str | None:
    """The tree-relative path of a production module, or None (third-party, stdlib, tests, bench)."""
    try:
        return _CACHE[filename]
    except KeyError:
        pass
    module: str | None = None
    path = Path(filename)
    if path.suffix == ".py" and path.is_absolute():
        try:
            rel = path.resolve().relative_to(_ROOT)
        except ValueError:
            rel = None
        if rel is not None and rel.parts[0] in PACKAGES:
            module = rel.as_posix()
    _CACHE[filename] = module
    return module


class Tracer:
    """Arms one window at a time; the profile function is installed only while a window is open."""

    def __init__(self) -> None:
        self.walk: Walk | None = None
        self.handlers: list[asyncio.Task[Any]] = []  # every request's task, traced or not
        self._next = 0

    def arm(self) -> Walk:
        self._next += 1
        self.walk = Walk(self._next)
        sys.setprofile(self._profile)
        return self.walk

    def disarm(self) -> None:
        sys.setprofile(None)
        if self.walk is not None:
            self.walk.finish()
        self.walk = None

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        walk = self.walk
        if walk is None or (event != "call" and event != "return"):
            return
        walk.event(frame, event, module_of)

    def task_factory(
        self, loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        """Every task started inside an open window's context: the window waits for them to end."""
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
        walk = self.walk
        context = kwargs.get("context")
        window = context.get(_WINDOW) if context is not None else _WINDOW.get()
        if walk is not None and window == walk.window:
            walk.tasks.append(task)
        return task


def _import_first(*names: str) -> Any:
    """The first of the dotted names that imports: the same object under the new and the old layout."""
    errors = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat, streamed": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True},
    ),
    "chat, not streamed": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
    ),
    "messages, streamed": (
        "/v1/messages",
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True},
    ),
}
HEADERS = {
    "Authorization": f"Bearer {DEMO_KEY}",
    "x-api-key": DEMO_KEY,
    "anthropic-version": "2023-06-01",
    "Content-Type": "application/json",
}


async def _send(base: str, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """One request on its own connection (closed after it); the status and the bytes read."""
    import aiohttp

    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(base + path, data=json.dumps(body), headers=HEADERS) as response,
    ):
        size = 0
        async for chunk in response.content.iter_any():
            size += len(chunk)
        return response.status, size


async def _wait_ready(base: str, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(base + "/readyz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the gateway was not ready within {timeout_s:.0f} s")


async def _trace_all(
    root: Path, max_tokens: int, warm_ups: int, repeats: int, ready_timeout_s: float
) -> dict[str, Any]:
    from aiohttp import web

    load_settings = _import_first("gateway.app.settings.load_settings", "gateway.settings.load_settings")
    create_app = _import_first("gateway.app.factory.create_app", "gateway.app.create_app")
    make_runner = _import_first("gateway.app.server.make_runner", "gateway.server.make_runner")

    settings = load_settings(root / "config" / "gateway.yaml")
    port = _free_port()
    settings = settings.model_copy(update={"server": settings.server.model_copy(update={"port": port})})
    app = create_app(settings)
    tracer = Tracer()

    async def window_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        walk = tracer.walk
        task = asyncio.current_task()
        if task is not None:
            tracer.handlers.append(task)
        if walk is not None:
            _WINDOW.set(walk.window)  # the rest of this request's task, and the tasks it starts
            if task is not None:
                walk.tasks.append(task)
        return await handler(request)

    app.middlewares.insert(0, web.middleware(window_middleware))
    asyncio.get_running_loop().set_task_factory(tracer.task_factory)
    runner = make_runner(app, settings)
    await runner.setup()
    results: dict[str, Any] = {}
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        base = f"http://127.0.0.1:{port}"
        await _wait_ready(base, ready_timeout_s)
        await _wait_endpoints(app, ready_timeout_s)
        warm_status: dict[str, int] = {}
        for _ in range(warm_ups):  # every kind first: pooled connections to each replica a request may pick
            for kind, (path, body) in REQUESTS.items():
                warm_status[kind], _ = await _send(base, path, {**body, "max_tokens": max_tokens})
        for kind, (path, body) in REQUESTS.items():
            runs = []
            for _ in range(repeats):
                # A handler ends after its client has read the last byte: its upstream connection goes
                # back to the pool then. Tracing before that would trace the opening of a new one.
                await _wait_tasks(tracer.handlers, timeout_s=10.0)
                await asyncio.sleep(0.2)
                walk = tracer.arm()
                try:
                    status, size = await _send(base, path, {**body, "max_tokens": max_tokens})
                    unfinished = await _wait_tasks(walk.tasks, timeout_s=10.0)
                finally:
                    tracer.disarm()
                runs.append({"status": status, "bytes": size, "unfinished_tasks": unfinished, **walk.report()})
            results[kind] = {"path": path, "warm_up_status": warm_status.get(kind, 0), "runs": runs}
    finally:
        await runner.cleanup()
    return results


async def _wait_endpoints(app: Any, timeout_s: float) -> None:
    """Every endpoint of every pool ready: with one of a pool's two still starting, routing has a
    single candidate and skips its filters and scorers, a shorter walk than a running gateway's."""
    fleet_key = _import_first("gateway.app.keys.FLEET", "gateway.appkeys.FLEET")
    fleet = app[fleet_key]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [str(endpoint.state) for endpoint in fleet.endpoints()]
        if states and all(state == "ready" for state in states):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"not every endpoint was ready within {timeout_s:.0f} s")


async def _wait_tasks(tasks: list[asyncio.Task[Any]], timeout_s: float) -> list[str]:
    """Wait for the request's task and the tasks it started (more may start meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(task.done() for task in tasks):
            return []
        await asyncio.sleep(0.01)
    return [task.get_name() + " " + repr(task.get_coro()) for task in tasks if not task.done()]


def room_of(module: str) -> str:
    """The room of a tree-relative module path: its top-level package, and `sim` for the simulated
    engine, which was `backends/sim/` before it became a package of its own."""
    parts = module.split("/")
    return "sim" if parts[:2] == ["backends", "sim"] else parts[0]


def count_modules(root: Path) -> dict[str, dict[str, int]]:
    """The production `.py` files of a tree per room, with and without `__init__.py`."""
    counts: dict[str, dict[str, int]] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root)
            if "tests" in rel.parts:
                continue
            room = counts.setdefault(room_of(rel.as_posix()), {"all": 0, "without_init": 0})
            room["all"] += 1
            room["without_init"] += path.name != "__init__.py"
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, required=True, help="the tree to trace (its packages are imported)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request asks for")
    parser.add_argument("--warm-ups", type=int, default=3, help="untraced requests of each kind before any is traced")
    parser.add_argument("--repeats", type=int, default=3, help="traced requests of each kind")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for /readyz")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds before it dumps its stacks and exits")
    parser.add_argument(
        "--cwd",
        type=Path,
        default=None,
        help="working directory, where the gateway's var/ files go (default: the tree)",
    )
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)  # a hung tree says where, instead of hanging
    global _ROOT
    _ROOT = args.root.resolve()
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # this script's folder: nothing there is the tree's
    sys.path.insert(0, str(_ROOT))
    # `python -m sim` (the engines) finds the tree first: cwd is its sys.path[0], PYTHONPATH the next
    os.chdir(args.cwd.resolve() if args.cwd is not None else _ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    import gateway

    where = Path(gateway.__file__ or "").resolve()
    if _ROOT not in where.parents:
        raise SystemExit(f"gateway imported from {where}, not from {_ROOT}")
    requests = asyncio.run(_trace_all(_ROOT, args.max_tokens, args.warm_ups, args.repeats, args.ready_timeout))
    report = {
        "root": str(_ROOT),
        "python": sys.version.split()[0],
        "max_tokens": args.max_tokens,
        "warm_ups": args.warm_ups,
        "production_modules": count_modules(_ROOT),
        "requests": requests,
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
