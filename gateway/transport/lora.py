"""Gateway-driven LoRA loading: an adapter is registered on a replica the first time a request for it
goes there, through the engine's `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`, vLLM's
runtime adapter API: docs.vllm.ai, "LoRA Adapters"). The engine keeps its own LRU of `max_loras` GPU
slots; registration is what the gateway does (docs/adapters.md).

One load per (endpoint, adapter) at a time: concurrent first requests await the same load. A load is
bounded by `timeout_s`, so a slow or dead engine fails the request, never hangs it. The answer:
`LoadFailed(status, message)`: the engine refused (4xx: the adapter is wrong everywhere) or did not
answer (status 0: that endpoint's fault), the message naming the adapter.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import orjson

from backends.lora import LoraAdapter
from backends.types import Endpoint
from gateway.upstream.client import UpstreamClient

MAX_REGISTERED = 65_536  # (endpoint, adapter) pairs remembered; the policy's names, not client input


class LoadFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AdapterLoader:
    def __init__(self, upstream: UpstreamClient, timeout_s: float = 30.0) -> None:
        self.upstream = upstream
        self.timeout_s = timeout_s
        self._registered: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.loads = 0
        self.failures = 0

    def registered(self, endpoint: Endpoint, adapter: str) -> bool:
        return (endpoint.id, adapter) in self._registered

    async def ensure(self, endpoint: Endpoint, adapter: LoraAdapter) -> None:
        """Register `adapter` on `endpoint` unless it is already; LoadFailed when the engine cannot."""
        key = (endpoint.id, adapter.name)
        if key in self._registered:
            return
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loading[key] = pending
            try:
                await self._load(endpoint, adapter)
            except LoadFailed as exc:
                self.failures += 1
                pending.set_exception(exc)
                pending.exception()  # retrieved: the waiters (if any) re-raise it
                raise
            finally:
                self._loading.pop(key, None)
            self._registered[key] = None
            while len(self._registered) > MAX_REGISTERED:
                self._registered.popitem(last=False)
            pending.set_result(None)
            return
        await asyncio.shield(pending)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint restarted or left: its adapters must be loaded again."""
        for key in [k for k in self._registered if k[0] == endpoint_id]:
            del self._registered[key]

    async def _load(self, endpoint: Endpoint, adapter: LoraAdapter) -> None:
        headers = {"Content-Type": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        body = orjson.dumps({"lora_name": adapter.name, "lora_path": adapter.source})
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.upstream.post(endpoint.base_url + "/v1/load_lora_adapter", headers, body)
                text = await response.read()
                response.release()
        except Exception as exc:  # no answer: refused, reset, timed out (the client's own errors included)
            raise LoadFailed(0, f"The adapter '{adapter.name}' could not be loaded on {endpoint.id}: {exc!r}") from None
        self.loads += 1
        if response.status == 200 or _already_loaded(response.status, text):
            return
        detail = _message(text)
        raise LoadFailed(
            response.status, f"The adapter '{adapter.name}' could not be loaded ({response.status}): {detail}"
        )


def _already_loaded(status: int, text: bytes) -> bool:
    """vLLM answers 400 "has already been loaded" to a second load of the same name: that is success."""
    return status == 400 and b"already been loaded" in text


def _message(text: bytes) -> str:
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text[:300].decode("utf-8", "replace")
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:300]
    return text[:300].decode("utf-8", "replace")
