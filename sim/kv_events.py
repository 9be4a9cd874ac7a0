"""KV cache events over ZMQ in vLLM's wire format (vllm/distributed/kv_events.py).

- PUB socket: endpoints with ``*``, ``::``, ``ipc://`` or ``inproc://`` bind, others connect; instance
  `i` of a multi-instance process uses port + i (as vLLM's DP ranks do).
- Each step with events sends ``[topic, seq (8-byte big-endian, from 0), msgpack([ts, events, 0])]``.
- `medium` is "GPU", or "CPU" for the host-DRAM tier (kv_cache.py, HostOffload: hashes only, as vLLM's
  offloading connector publishes them).
- Events, vLLM 0.33 ("tagged"): maps ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name", "group_idx", "extra_keys"}`` (the first
  block of a salted prompt carries its `cache_salt` in `extra_keys`, after the adapter's name that every
  block of a LoRA request carries first, as vLLM's `to_event_extra_keys` writes them), ``{"type":
  "BlockRemoved", "block_hashes", "medium", "group_idx"}``, ``{"type": "AllBlocksCleared"}``. Older
  releases ("positional"): ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``,
  ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``.
- Replay (optional ``replay_endpoint``): a ROUTER; a REQ sends a start seq (8 bytes) and gets every
  buffered batch from there as ``[topic, seq, payload]``, then ``[b"", -1, b""]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from sim.config import KVEventsConfig
from sim.kv_cache import KVEvent

log = logging.getLogger("tokenway.sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str, offset: int) -> str:
    """tcp://host:5557 → tcp://host:(5557+offset); other schemes get a suffix."""
    if offset == 0:
        return endpoint
    match = re.match(r"^(tcp://.+):(\d+)$", endpoint)
    if match and match[2] != "0":
        return f"{match[1]}:{int(match[2]) + offset}"
    return endpoint if match else f"{endpoint}_{offset}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_event(event: KVEvent, block_size: int, positional: bool) -> Any:
    if event.kind == "stored":
        extra_keys = [list(keys) if keys else None for keys in event.extra_keys] if event.extra_keys else None
        if positional:
            stored = [
                "BlockStored",
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                block_size,
                None,
                event.medium,
            ]
            if event.lora_name:
                return [*stored, event.lora_name, extra_keys]
            return [*stored, None, extra_keys] if extra_keys else stored
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "group_idx": 0,
            "extra_keys": extra_keys,
        }
    if event.kind == "removed":
        if positional:
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": 0,
        }
    return ["AllBlocksCleared"] if positional else {"type": "AllBlocksCleared"}


class KVEventPublisher:
    """One engine's PUB socket (and optional replay ROUTER)."""

    def __init__(self, config: KVEventsConfig, block_size: int, instance_index: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.positional = config.format == "positional"
        self.topic = config.topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self.endpoint = offset_endpoint(config.endpoint, instance_index)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, config.hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        if _binds(self.endpoint):
            self.socket.bind(self.endpoint)
        else:
            self.socket.connect(self.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if config.replay_endpoint:
            self.replay_endpoint = offset_endpoint(config.replay_endpoint, instance_index)
            self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        encoded = [encode_event(e, self.block_size, self.positional) for e in events]
        payload = msgpack.packb([time.time(), encoded, 0], use_bin_type=True)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) < 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._replay is not None:
            self._replay.close(0)
        self.socket.close(0)
