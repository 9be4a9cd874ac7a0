"""Which LoRA adapters each engine holds, read from the engine itself: `GET /v1/models`.

The gateway knows the adapters it loaded; an engine may hold others: a static endpoint started with
`--lora-modules`, adapters another gateway (or an operator) loaded, or none of those it loaded after a
restart. vLLM lists every registered adapter in `/v1/models` beside the base model, with the base
model as `parent` (docs.vllm.ai, "LoRA Adapters", serving adapters: the models list shows each
adapter with `"parent"` naming its base); the base model's own entry has `parent: null`.

Every `lora_discovery_interval_s` each READY or DRAINING endpoint of a vLLM-compatible engine whose
pool serves the base model of some declared adapter gets one GET (its own task, as scrapes are: a slow
engine delays no other). The answer sets `Endpoint.loras` (the adapter names) and `loras_at_s` (when
the request was sent: a registration made after it may not be listed yet). Routing reads it
(`policies/routing/lora.py`: a listed adapter needs no load) and the loader trusts it (a listed adapter
is not loaded again; one it loaded before `loras_at_s` and no longer listed is loaded again).

Bounded: at most `MAX_LISTED` names per endpoint; endpoints are the fleet's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp
import orjson

from backends.config import BackendsSettings
from backends.fleet import Fleet
from backends.health import EndpointTasks
from backends.types import Endpoint, EndpointState

log = logging.getLogger(__name__)

# engine kinds whose /v1/models lists runtime LoRA adapters with `parent` (the simulator serves it as vLLM does)
LISTING_ENGINES = frozenset({"vllm", "vllm-ascend", "sim"})
LISTED_STATES = frozenset({EndpointState.READY, EndpointState.DRAINING})
MAX_LISTED = 4096  # names kept per endpoint: an engine's answer is not trusted to be small


def listed_adapters(payload: bytes) -> frozenset[str] | None:
    """The adapter ids of a `/v1/models` answer (entries whose `parent` names another model), or None
    when the answer is not a models list."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    names: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and parent and parent != name:
            names.add(name)
            if len(names) >= MAX_LISTED:
                break
    return frozenset(names)


def serving_pools(fleet: Fleet) -> set[str]:
    """The pools that serve the base model of a declared adapter (the only ones worth asking)."""
    bases = {adapter.base_model for adapter in fleet.adapters.values()}
    return {name for name, pool in fleet.pools.items() if pool.config.model in bases}


class LoraDiscovery:
    """One pass per interval: which endpoints to ask now; each answer lands on its `Endpoint`."""

    def __init__(self, settings: BackendsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._tasks = EndpointTasks("lora discovery")
        self._warned: set[str] = set()

    def candidates(self, fleet: Fleet) -> Iterable[Endpoint]:
        pools = serving_pools(fleet)
        for name in pools:
            for endpoint in fleet.pools[name].endpoints:
                if endpoint.engine in LISTING_ENGINES and endpoint.state in LISTED_STATES:
                    yield endpoint

    async def discover(self, endpoint: Endpoint, session: aiohttp.ClientSession) -> bool:
        """One GET of one endpoint's models; True when `endpoint.loras` was updated."""
        sent_s = self.clock()
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            async with session.get(endpoint.base_url + "/v1/models", headers=headers, timeout=timeout) as response:
                body = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("lora discovery %s: %r", endpoint.id, exc)
            return False
        names = listed_adapters(body) if status == 200 else None
        if names is None:
            if endpoint.id not in self._warned:
                self._warned.add(endpoint.id)
                log.warning("endpoint %s: /v1/models answered %d without a models list", endpoint.id, status)
            return False
        endpoint.loras = names
        endpoint.loras_at_s = sent_s
        return True

    def tick(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        for endpoint in self.candidates(fleet):
            if not self._tasks.busy(endpoint.id):
                self._tasks.start(endpoint.id, self.discover(endpoint, session))

    async def close(self) -> None:
        await self._tasks.close()


async def run(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    settings: BackendsSettings,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Ask every adapter-serving endpoint for its adapters every `lora_discovery_interval_s` until cancelled."""
    discovery = LoraDiscovery(settings, clock)
    try:
        while True:
            discovery.tick(fleet, session)
            await asyncio.sleep(settings.lora_discovery_interval_s)
    finally:
        await discovery.close()
