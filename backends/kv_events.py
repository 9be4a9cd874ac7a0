"""KV-cache events from engines over ZMQ, in vLLM's wire format, decoded for the precise prefix index.

Wire format (vLLM `ZmqEventPublisher`, vllm/distributed/kv_events.py): a PUB socket sends 3 frames
`[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]`, with `KVEventBatch = [ts, events,
data_parallel_rank]`. Events are maps tagged `"type"` (vLLM >= 0.11, `omit_defaults`) or positional
arrays led by their tag (older releases); both are decoded here:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids": [...],
     "block_size": 16, "medium": "GPU", "lora_name": None, "extra_keys": [...]}
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}  /  ["BlockRemoved", block_hashes, medium]
    {"type": "AllBlocksCleared"}  /  ["AllBlocksCleared"]

Block hashes arrive as 64-bit ints or as digests (bytes, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`);
digests are reduced to their low 64 bits exactly as vLLM does for ints.

The subscriber tracks sequence numbers: a gap is repaired through the engine's replay socket (ROUTER;
we send the first missing seq as 8 bytes and read batches until seq -1) when one is configured, and
otherwise reported through `on_reset(endpoint_id, "gap")` so the consumer can stop trusting its
state; a sequence that goes backwards with a newer timestamp means the engine restarted
(`on_reset(..., "restart")`), with an older or equal one it is a batch already replayed (dropped).
When the subscription starts, the replay socket is asked for everything it still buffers, so a
gateway started after the engine already holds blocks knows them at once instead of waiting for the
engine's next `BlockStored`. ZMQ reconnects by itself, so an engine that restarts on the same address
is picked up again.

What an engine publishes is input, and is checked here once, at the edge, so consumers (the precise
prefix index) never see a shape they would fail on or a value they would store unbounded. A message
is decoded whole or not at all: one that breaks a rule below counts in `decode_errors`, is logged as
a warning once per subscription (then at debug), and is dropped as a lost batch (the next batch's
sequence number shows the gap, repaired through the replay socket or reported as one). The rules:

- a frame of at most `MAX_MESSAGE_BYTES` (ZMQ `MAXMSGSIZE`: a peer sending more is disconnected,
  counted in `disconnects`, and a new socket connects, its queued batches lost), a message of 2 or
  3 frames (the rest of a longer one is read and dropped, not kept), at most `RCV_HWM` messages
  queued per subscription (more are dropped by the publisher: a gap);
- a sequence number in 0..`MAX_SEQ` (the replay's end marker -1 aside), a timestamp that is a finite
  number at most `MAX_CLOCK_AHEAD_S` ahead of this host's clock, events a list;
- `BlockStored`: hashes ints or digests; `token_ids` unsigned 32-bit ints (kept as an `array('I')`);
  `block_size` absent or 1..`MAX_BLOCK_SIZE`; `medium` and `lora_name` absent or strings of at most
  `MAX_NAME_CHARS`; `extra_keys` absent or a list;
- a replay answers at most `MAX_REPLAY_BATCHES` messages (vLLM buffers 10,000 steps) before the
  subscriber stops reading it, so a replay socket that answers forever cannot hold the live stream.

Any other failure while handling a message is logged (with its traceback: it is a bug) and the
subscription goes on: one message never ends a subscriber.

No imports from the other rooms: consumers pass plain callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
END_OF_REPLAY = -1
# Bounds on what an engine publishes (the module docstring). A vLLM step's batch holds the token ids
# of the blocks it stored (a few to 7 bytes each, a digest hash 34 bytes per block): 2 MiB is
# hundreds of thousands of tokens in one step, far beyond any engine's batched-token budget.
MAX_MESSAGE_BYTES = 2 << 20
MAX_FRAMES = 3
RCV_HWM = 1000  # messages queued per subscription: seconds of a busy engine's steps, at most 2 GiB of frames
MAX_SEQ = (1 << 63) - 2  # so that the next expected seq still fits the 8 signed bytes a replay request sends
MAX_BLOCK_SIZE = 1 << 16
MAX_NAME_CHARS = 1024
MAX_CLOCK_AHEAD_S = 86_400.0  # a batch's timestamp may run ahead of this host's clock by as much
MAX_REPLAY_BATCHES = 10_001  # vLLM's replay buffer holds `buffer_steps` (10,000 by default) batches

RESET_GAP = "gap"  # events were lost and could not be replayed: the consumer's state may be wrong
RESET_RESTART = "restart"  # the engine restarted: its cache is empty


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Any] | None = None  # one entry per block (None or a tuple), vLLM's untagged form


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[int]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. a cache reset): forget every block of it."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int
    ts: float
    events: Sequence[KvEvent]
    dp_rank: int | None = None
    topic: str = ""
    received_at_s: float = 0.0  # time.monotonic() when the subscriber received it


class KvEventDecodeError(ValueError):
    """A frame or payload that is not vLLM's KV-event format."""


# --- decoding (pure) ---------------------------------------------------------------------------------


def block_hash(value: Any) -> int:
    """A block hash as a 64-bit unsigned int (ints as sent, digests by their low 64 bits)."""
    if isinstance(value, int):
        return value & MASK64
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & MASK64
    raise KvEventDecodeError(f"block hash of type {type(value).__name__}")


def _hashes(values: Any) -> list[int]:
    if values is None:
        return []
    if not isinstance(values, list | tuple):
        raise KvEventDecodeError("block_hashes is not a list")
    return [block_hash(v) for v in values]


def _get(seq: Sequence[Any], index: int) -> Any:
    return seq[index] if len(seq) > index else None


def _token_ids(value: Any) -> Sequence[int]:
    """Token ids as an `array('I')`: the conversion checks every id (an int of 0..2^32-1) in C, and
    it is the form the index hashes without another copy."""
    if value is None:
        return array("I")
    if not isinstance(value, list | tuple):
        raise KvEventDecodeError(f"token_ids of type {type(value).__name__}")
    try:
        return array("I", value)
    except (TypeError, OverflowError) as exc:
        raise KvEventDecodeError(f"token_ids: {exc}") from exc


def _block_size(value: Any) -> int:
    """0 when absent (the consumer keeps the size it knows), else 1..MAX_BLOCK_SIZE."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise KvEventDecodeError(f"block_size {value!r:.40}")
    return value


def _name(value: Any, field_name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise KvEventDecodeError(f"{field_name} of type {type(value).__name__}, or longer than {MAX_NAME_CHARS}")
    return value


def _extra_keys(value: Any) -> Sequence[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise KvEventDecodeError(f"extra_keys of type {type(value).__name__}")
    return value


def _stored(hashes: Any, parent: Any, token_ids: Any, size: Any, medium: Any, lora: Any, extra: Any) -> BlockStored:
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=None if parent is None else block_hash(parent),
        token_ids=_token_ids(token_ids),
        block_size=_block_size(size),
        medium=_name(medium, "medium"),
        lora_name=_name(lora, "lora_name"),
        extra_keys=_extra_keys(extra),
    )


def _timestamp(value: Any) -> float:
    """A finite time, not past a day from now: the subscriber takes a replayed batch's timestamp as
    the newest it delivered, and one from the far future would make every later batch look already
    delivered (dropped as a duplicate) for as long."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise KvEventDecodeError(f"batch timestamp {value!r:.40}")
    if value > time.time() + MAX_CLOCK_AHEAD_S:
        raise KvEventDecodeError(f"batch timestamp {value!r:.40} is in the future")
    return float(value)


def decode_event(raw: Any) -> KvEvent | None:
    """One event, map- or array-shaped; None for event types this gateway does not use."""
    if isinstance(raw, Mapping):
        kind = raw.get("type")
        if kind == "BlockStored":
            get = raw.get
            return _stored(
                get("block_hashes"),
                get("parent_block_hash"),
                get("token_ids"),
                get("block_size"),
                get("medium"),
                get("lora_name"),
                get("extra_keys"),
            )
        if kind == "BlockRemoved":
            medium = _name(raw.get("medium"), "medium")
            return BlockRemoved(block_hashes=_hashes(raw.get("block_hashes")), medium=medium)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        if kind is None:
            raise KvEventDecodeError("event map without 'type'")
        return None
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == "BlockStored":
            return _stored(*(_get(raw, i) for i in (1, 2, 3, 4, 6, 7, 8)))
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_hashes(_get(raw, 1)), medium=_name(_get(raw, 2), "medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise KvEventDecodeError(f"event of type {type(raw).__name__}")


def decode_payload(payload: bytes) -> tuple[float, list[KvEvent], int | None]:
    """msgpack `KVEventBatch` -> (ts, events, dp_rank); array or map shaped."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KvEventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, Mapping):
        ts, raw_events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, raw_events, dp_rank = raw[0], raw[1], _get(raw, 2)
    else:
        raise KvEventDecodeError("batch is neither [ts, events, dp_rank] nor a map")
    if not isinstance(raw_events, list | tuple):
        raise KvEventDecodeError("batch events is not a list")
    events = [e for e in (decode_event(r) for r in raw_events) if e is not None]
    dp = dp_rank if isinstance(dp_rank, int) and not isinstance(dp_rank, bool) else None
    return _timestamp(ts), events, dp


def decode_seq(frame: bytes) -> int:
    """The 8-byte signed sequence number (a replay's end marker is -1; `decode_frames` checks the range)."""
    if len(frame) != 8:
        raise KvEventDecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_frames(frames: Sequence[bytes], received_at_s: float = 0.0) -> KvEventBatch:
    """A published message: `[topic, seq, payload]` (or `[seq, payload]` from old replay servers)."""
    if len(frames) == 3:
        topic, seq_frame, payload = frames
    elif len(frames) == 2:
        topic, (seq_frame, payload) = b"", frames
    else:
        raise KvEventDecodeError(f"message of {len(frames)} frames")
    seq = decode_seq(seq_frame)
    if not 0 <= seq <= MAX_SEQ:
        raise KvEventDecodeError(f"sequence number {seq}")
    ts, events, dp_rank = decode_payload(payload)
    return KvEventBatch(
        seq=seq,
        ts=ts,
        events=events,
        dp_rank=dp_rank,
        topic=bytes(topic).decode("utf-8", "replace"),
        received_at_s=received_at_s,
    )


# --- subscriber (I/O) --------------------------------------------------------------------------------

BatchCallback = Callable[[str, KvEventBatch], None]
ResetCallback = Callable[[str, str], None]


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    lost: int = 0  # gaps the replay socket could not fill (the consumer was told to stop trusting its state)
    replayed_batches: int = 0
    catch_ups: int = 0  # start-up replays that delivered at least one batch
    duplicates: int = 0  # live batches already delivered by a replay
    resets: int = 0
    decode_errors: int = 0
    disconnects: int = 0  # the publisher's connection ended (a restart, or a message past the bound)
    last_seq: int | None = None
    last_batch_at_s: float = 0.0
    running: bool = False


@dataclass(slots=True)
class KvEventSubscriber:
    """One engine's KV-event stream, delivered batch by batch to `on_batch(endpoint_id, batch)`.

    `address` is where to connect (e.g. "tcp://10.0.0.5:5557"; vLLM's `tcp://*:5557` bind form must be
    turned into the engine's host first). `topic` is a prefix filter ("" = every topic).
    """

    endpoint_id: str
    address: str
    on_batch: BatchCallback
    on_reset: ResetCallback | None = None
    topic: str = ""
    replay_address: str | None = None
    replay_timeout_s: float = 2.0
    # A batch published after the start-up catch-up but before the SUB's subscription reached the
    # publisher is dropped by the publisher (ZMQ's slow joiner), and with no later batch no gap ever
    # shows it. So until the first live batch arrives the catch-up repeats until the engine answers,
    # then once more after this long: longer than the SUB's RECONNECT_IVL_MAX, so by then it is
    # connected and subscribed.
    catch_up_s: float = 2.5
    context: zmq.asyncio.Context | None = None
    stats: SubscriberStats = field(default_factory=SubscriberStats)
    _expected_seq: int | None = field(default=None, init=False)
    _replayed_end: int = field(default=0, init=False)  # 1 + the highest seq a replay delivered
    _replayed_ts: float = field(default=float("-inf"), init=False)  # the newest ts a replay delivered
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _warned: bool = field(default=False, init=False)  # an undecodable message was logged as a warning

    async def run(self) -> None:
        """Receive until `stop()` or cancellation; never raises on bad input (counts and logs it)."""
        sock, monitor = self._open()
        self.stats.running = True
        try:
            # Live batches published during a catch-up queue on the SUB socket and are deduplicated.
            catching_up, answered_before, catch_up_at = bool(self.replay_address), False, 0.0
            while not self._stop.is_set():
                if catching_up and time.monotonic() >= catch_up_at:
                    answered = await self._catch_up()
                    # done once the engine answered twice, catch_up_s apart: the SUB had time to connect
                    catching_up, answered_before = not (answered_before and answered), answered
                    catch_up_at = time.monotonic() + self.catch_up_s
                poller = zmq.asyncio.Poller()
                poller.register(sock, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
                ready = dict(await poller.poll(timeout=200))
                if monitor in ready:
                    # ZMQ ends a connection whose peer sent a frame past MAXMSGSIZE as a protocol
                    # error and never reconnects after one: the subscription would be dead for good.
                    # A new socket (not disconnect + connect on this one: libzmq aborts the process
                    # when a pipe holding part of a message ends under a reader) starts afresh;
                    # whatever it queued is lost, and shows as a gap.
                    self.stats.disconnects += 1
                    log.info("kv events from %s: disconnected from %s; reconnecting", self.endpoint_id, self.address)
                    _close(sock, monitor)
                    sock, monitor = self._open()
                    continue
                if sock not in ready:
                    continue
                frames = await _recv_bounded(sock)
                try:
                    await self._handle(frames)
                except Exception:  # a bug: logged with its traceback, and the subscription goes on
                    log.exception("kv events from %s: failed handling a message", self.endpoint_id)
                catching_up = False  # subscribed: from here on a lost batch shows as a gap
        finally:
            self.stats.running = False
            _close(sock, monitor)

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """The SUB socket, connected, and a monitor of its disconnections."""
        ctx = self.context or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        return sock, monitor

    def stop(self) -> None:
        self._stop.set()

    async def _catch_up(self) -> bool:
        """Replay what the engine still buffers from the next batch expected (all of it before the
        first); True when the engine answered."""
        before = self.stats.replayed_batches
        answered = await self._replay(self._expected_seq or 0, None, strict=False)
        if self.stats.replayed_batches > before:
            self.stats.catch_ups += 1
        return answered

    async def _handle(self, frames: Sequence[bytes]) -> None:
        now_s = time.monotonic()
        try:
            batch = decode_frames(frames, now_s)
        except KvEventDecodeError as exc:
            self._undecodable(exc)
            return
        expected = self._expected_seq
        if expected is None:
            if batch.seq > 0 and self.replay_address:
                await self._replay(0, batch.seq, strict=False)
        elif batch.seq < min(expected, self._replayed_end) and batch.ts <= self._replayed_ts:
            self.stats.duplicates += 1  # published while a replay delivered it
            return
        elif batch.seq < expected:
            log.info("kv events from %s: seq went back %d -> %d (restart)", self.endpoint_id, expected, batch.seq)
            self._reset(RESET_RESTART)
            if batch.seq > 0 and self.replay_address:
                await self._replay(0, batch.seq, strict=False)
        elif batch.seq > expected:
            self.stats.gaps += 1
            if not (self.replay_address and await self._replay(expected, batch.seq)):
                self.stats.lost += 1  # a warning the first time, debug afterwards (as `_undecodable`)
                level = logging.WARNING if self.stats.lost == 1 else logging.DEBUG
                log.log(level, "kv events from %s: lost seq %d..%d (%d gaps lost so far)",
                        self.endpoint_id, expected, batch.seq - 1, self.stats.lost)  # fmt: skip
                self._reset(RESET_GAP)
        self._deliver(batch)

    def _undecodable(self, exc: KvEventDecodeError, where: str = "message") -> None:
        """Counted always; a warning the first time, debug afterwards (an engine that publishes
        garbage would otherwise write a line per batch)."""
        self.stats.decode_errors += 1
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "kv events from %s: undecodable %s (dropped, %d so far): %s",
                self.endpoint_id, where, self.stats.decode_errors, exc)  # fmt: skip

    def _deliver(self, batch: KvEventBatch) -> None:
        self._expected_seq = batch.seq + 1
        self.stats.last_seq = batch.seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_batch_at_s = batch.received_at_s
        try:
            self.on_batch(self.endpoint_id, batch)
        except Exception:  # a consumer bug must not kill the subscription
            log.exception("kv events from %s: consumer failed on seq %d", self.endpoint_id, batch.seq)

    def _reset(self, reason: str) -> None:
        self.stats.resets += 1
        self._expected_seq = None
        # what an earlier replay delivered says nothing about the stream from here (a seq it reached
        # far ahead would otherwise mark every later batch a duplicate)
        self._replayed_end, self._replayed_ts = 0, float("-inf")
        if self.on_reset is not None:
            try:
                self.on_reset(self.endpoint_id, reason)
            except Exception:
                log.exception("kv events from %s: reset consumer failed", self.endpoint_id)

    async def _replay(self, first_seq: int, until_seq: int | None, *, strict: bool = True) -> bool:
        """Fetch batches [first_seq, until_seq) from the replay socket and deliver them in order
        (`until_seq` None: everything the engine still buffers).

        True when every missing batch arrived (None: when the engine answered). `strict=False`
        (catching up after subscribing late) accepts a buffer that starts after `first_seq`: older
        events are gone either way. A DEALER with an empty delimiter frame can read the several
        replies a ROUTER streams (a REQ would take one).
        """
        assert self.replay_address is not None
        ctx = self.context or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(self.replay_address)
        got = first_seq
        finished = False
        try:
            await sock.send_multipart([b"", first_seq.to_bytes(8, "big", signed=True)])
            for _ in range(MAX_REPLAY_BATCHES):  # a replay that answers forever holds the live stream
                if not await sock.poll(timeout=int(self.replay_timeout_s * 1000)):
                    break
                frames = await _recv_bounded(sock, 1 + MAX_FRAMES)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                seq_frame = frames[1] if len(frames) == 3 else frames[0] if frames else b""
                try:
                    seq = decode_seq(seq_frame)
                except KvEventDecodeError as exc:
                    self._undecodable(exc, "replay answer")
                    break
                if seq == END_OF_REPLAY:
                    finished = True
                    break
                if seq < got or (until_seq is not None and seq >= until_seq):
                    continue
                if seq > got:
                    if strict:
                        break  # the replay buffer no longer holds what we missed
                    got = seq
                try:
                    batch = decode_frames(frames, time.monotonic())
                except KvEventDecodeError as exc:
                    self._undecodable(exc, "replay answer")
                    break
                self.stats.replayed_batches += 1
                self._replayed_end = max(self._replayed_end, seq + 1)
                self._replayed_ts = max(self._replayed_ts, batch.ts)
                self._deliver(batch)
                got = seq + 1
        finally:
            sock.close(linger=0)
        return finished if until_seq is None else got >= until_seq


async def _recv_bounded(sock: zmq.asyncio.Socket, keep: int = MAX_FRAMES) -> list[bytes]:
    """One message, its first `keep` frames and, when it has more, one empty frame in their place
    (so it fails to decode): the rest are read and dropped, never held (`recv_multipart` would keep
    every frame of a message of millions)."""
    frames = [await sock.recv()]
    extra = False
    while sock.getsockopt(zmq.RCVMORE):
        frame = await sock.recv()
        if len(frames) < keep:
            frames.append(frame)
        else:
            extra = True
    if extra:
        frames.append(b"")
    return frames


def _close(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class KvEventHub:
    """One subscriber task per endpoint that publishes KV events, kept in step with the fleet.

    Owned by the gateway's app factory (a cleanup context): `sync(...)` after fleet changes,
    `await close()` at shutdown.
    """

    def __init__(
        self,
        on_batch: BatchCallback,
        on_reset: ResetCallback | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._context = context
        self._subs: dict[str, tuple[KvEventSubscriber, asyncio.Task[None]]] = {}

    def ensure(self, endpoint_id: str, address: str, *, topic: str = "", replay_address: str | None = None) -> None:
        """Subscribe to `address` for `endpoint_id` (re-subscribing when the address changed)."""
        current = self._subs.get(endpoint_id)
        if current is not None:
            sub, task = current
            if sub.address == address and sub.topic == topic and not task.done():
                return
            self.discard(endpoint_id)
        sub = KvEventSubscriber(
            endpoint_id,
            address,
            self._on_batch,
            self._on_reset,
            topic=topic,
            replay_address=replay_address,
            context=self._context,
        )
        task = asyncio.get_running_loop().create_task(sub.run(), name=f"kv-events:{endpoint_id}")
        self._subs[endpoint_id] = (sub, task)

    def discard(self, endpoint_id: str) -> None:
        current = self._subs.pop(endpoint_id, None)
        if current is not None:
            sub, task = current
            sub.stop()
            task.cancel()

    def sync(self, sources: Iterable[tuple[str, str]], *, topic: str = "") -> None:
        """Subscribe to exactly these `(endpoint_id, address)` pairs."""
        wanted = dict(sources)
        for endpoint_id in list(self._subs):
            if endpoint_id not in wanted:
                self.discard(endpoint_id)
        for endpoint_id, address in wanted.items():
            self.ensure(endpoint_id, address, topic=topic)

    def stats(self) -> dict[str, SubscriberStats]:
        return {endpoint_id: sub.stats for endpoint_id, (sub, _) in self._subs.items()}

    async def close(self) -> None:
        tasks = []
        for endpoint_id in list(self._subs):
            tasks.append(self._subs[endpoint_id][1])
            self.discard(endpoint_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
