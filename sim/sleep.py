"""vLLM's sleep mode on the simulated engine: `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`.

As in vLLM, the routes exist only when the server runs in development mode (``VLLM_SERVER_DEV_MODE=1``)
and the engine with ``--enable-sleep-mode``; otherwise they answer 404.

- ``POST /sleep?level=1|2&mode=abort|wait|keep`` (defaults 1, abort): `abort` ends every request in
  the engine at once (finish reason ``abort``), `wait` lets them finish first, `keep` holds them in the
  queue and recomputes them after the wake-up. Then the KV cache is dropped (``AllBlocksCleared``) and
  level 1 copies the weights to host memory over PCIe; level 2 discards them. The response comes when
  the engine is asleep. Sleeping twice is a no-op, as in vLLM.
- ``POST /wake_up[?tags=weights&tags=kv_cache]``: brings back the tagged memory (all of it by default)
  and answers once it is back: weights over PCIe after level 1, reloaded from storage after level 2
  (`backends/perf/loading.py`). The engine is awake when no tag is left asleep.
- ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.

While asleep, or going to sleep, the routes that need the weights (chat, completions, embeddings,
responses, messages) answer 503 with vLLM's ``ModelSleepingError`` body; `/tokenize`, `/v1/models`,
`/health` and `/metrics` keep working. `vllm:engine_sleep_state` (``awake``, ``weights_offloaded``, ``discard_all``)
is exported by `metrics.py`; each operation's simulated duration goes to
`vllm:sleep_mode_operation_duration_seconds{operation}`. Durations are simulated seconds, slept in
real time divided by the engine's time scale.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

import orjson
from aiohttp import web

from backends.perf import loading

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

    from sim.engine import SimEngine

log = logging.getLogger("tokenway.sim")

TAGS: Final = ("weights", "kv_cache")
MODES: Final = ("abort", "wait", "keep")
# Routes that run the model: refused while the weights are away.
PROTECTED_PATHS: Final = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"}
)
SLEEPING_MESSAGE: Final = "Model is currently in sleep mode. Please wake it up first with a POST request to /wake_up"


class SleepMode:
    """One engine's sleep state and its transitions (one at a time)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.level = 0  # the level it went to sleep at; 0 while awake
        self.sleeping_tags: set[str] = set()
        self.pausing = False  # between a /sleep call and the engine being asleep
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @property
    def accepting(self) -> bool:
        """Whether requests that need the weights may enter."""
        return not self.sleeping_tags and not self.pausing

    def state_level(self) -> int:
        """0 awake, else the level slept at (the `vllm:engine_sleep_state` series that is 1)."""
        return self.level if self.sleeping_tags else 0

    async def sleep(self, level: int, mode: str) -> None:
        engine = self.engine
        duration = 0.0
        async with self._lock:
            if self.sleeping_tags:
                log.warning("the engine is already sleeping")
                return
            self.pausing = True
            try:
                if mode == "abort":
                    engine.abort_all()
                elif mode == "wait":
                    await engine.wait_drained()
                else:  # keep: queued and running requests stay, to be recomputed after the wake-up
                    engine.paused = True
                    engine.abort_all(pulling_only=True)
                engine.paused = True
                if not engine.discard_kv():
                    log.warning("KV blocks still in use while going to sleep")
                duration = loading.sleep_s(engine.preset, level)
                await self._take(duration)
                engine.metrics.observe_sleep_operation("sleep", duration)
                self.level = level
                self.sleeping_tags = set(TAGS)
            except BaseException:
                engine.resume()
                raise
            finally:
                self.pausing = False
        log.info("engine asleep at level %d (%.2f s simulated)", level, duration)

    async def wake_up(self, tags: list[str] | None) -> None:
        engine = self.engine
        async with self._lock:
            if not self.sleeping_tags:
                log.warning("the engine is not sleeping")
                return
            wanted = set(tags) if tags else set(self.sleeping_tags)
            wanted &= self.sleeping_tags
            duration = 0.0
            if "weights" in wanted:
                duration = loading.wake_s(engine.preset, self.level, engine.config.load_bandwidth)
            await self._take(duration)
            engine.metrics.observe_sleep_operation("wake", duration)
            self.sleeping_tags -= wanted
            if not self.sleeping_tags:
                self.level = 0
                engine.resume()
        log.info("woke %s (%.2f s simulated)", ", ".join(sorted(wanted)) or "nothing", duration)

    async def _take(self, simulated_s: float) -> None:
        if simulated_s > 0:
            await asyncio.sleep(simulated_s / self.engine.config.time_scale)


def routes_enabled(engine: SimEngine) -> bool:
    return engine.config.enable_sleep_mode and engine.config.server_dev_mode


def install(app: web.Application, engine: SimEngine) -> None:
    """Add the sleep routes and the 503 guard to the engine's app, when vLLM would have them."""
    if not routes_enabled(engine):
        return
    state = engine.sleep_mode

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not state.accepting and request.path in PROTECTED_PATHS:
            return _error(503, "ModelSleepingError", SLEEPING_MESSAGE)
        return await handler(request)

    async def sleep(request: web.Request) -> web.StreamResponse:
        level_text = request.query.get("level", "1")
        mode = request.query.get("mode", "abort")
        if not level_text.isdigit() or int(level_text) not in loading.SLEEP_LEVELS:
            return _error(400, "BadRequestError", f"level must be one of {loading.SLEEP_LEVELS}")
        if mode not in MODES:
            return _error(400, "BadRequestError", f"mode must be one of {MODES}")
        await state.sleep(int(level_text), mode)
        return web.Response(status=200)

    async def wake_up(request: web.Request) -> web.StreamResponse:
        tags = request.query.getall("tags", [])
        unknown = [tag for tag in tags if tag not in TAGS]
        if unknown:
            return _error(400, "BadRequestError", f"unknown tags {unknown}; known: {list(TAGS)}")
        await state.wake_up(tags or None)
        return web.Response(status=200)

    async def is_sleeping(_request: web.Request) -> web.StreamResponse:
        return web.Response(body=orjson.dumps({"is_sleeping": state.is_sleeping}), content_type="application/json")

    app.middlewares.append(guard)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


def _error(status: int, kind: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
