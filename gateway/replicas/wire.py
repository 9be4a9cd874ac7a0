"""The stream entries replicas exchange: one msgpack map per batch, under field `b` (field `r` holds
the publisher's id as well, so a reader skips its own entries without decoding them).

    {"r": replica id, "q": sequence number,
     "l": [[endpoint id, requests, prefill tokens, decode tokens], ...]   # present: a full load report
     "d": [[endpoint id, [block key, ...], session or None], ...]}        # dispatches since the last batch

A load report is the replica's whole share on every shared endpoint (an endpoint left out has none
of its requests), so a report replaces the previous one and nothing accumulates when one is lost.
Decoding checks every type: an entry is read from a store other processes write, and a malformed
one is dropped whole, never half applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

Load = tuple[str, int, int, int]
Dispatch = tuple[str, list[int], str | None]

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class Batch:
    replica: str
    sequence: int
    loads: list[Load] | None = None  # None: no load report in this batch
    dispatches: list[Dispatch] = field(default_factory=list)


def encode(batch: Batch) -> bytes:
    doc: dict[str, object] = {"r": batch.replica, "q": batch.sequence}
    if batch.loads is not None:
        doc["l"] = [list(load) for load in batch.loads]
    if batch.dispatches:
        doc["d"] = [[e, keys, s] for e, keys, s in batch.dispatches]
    return bytes(msgpack.packb(doc, use_bin_type=True))


class MalformedBatch(ValueError):
    pass


def decode(data: bytes) -> Batch:
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedBatch(str(exc)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("r"), str) or not isinstance(doc.get("q"), int):
        raise MalformedBatch("not a batch")
    batch = Batch(doc["r"], doc["q"])
    if "l" in doc:
        loads = doc["l"]
        if not isinstance(loads, list):
            raise MalformedBatch("loads")
        batch.loads = []
        for item in loads:
            if (
                not isinstance(item, list)
                or len(item) != 4
                or not isinstance(item[0], str)
                or not all(isinstance(v, int) and v >= 0 for v in item[1:])
            ):
                raise MalformedBatch("load")
            batch.loads.append((item[0], item[1], item[2], item[3]))
    for item in doc.get("d") or []:
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str):
            raise MalformedBatch("dispatch")
        keys, session = item[1], item[2]
        if not isinstance(keys, list) or not all(isinstance(k, int) and 0 <= k <= _MASK64 for k in keys):
            raise MalformedBatch("keys")
        if session is not None and not isinstance(session, str):
            raise MalformedBatch("session")
        batch.dispatches.append((item[0], keys, session))
    return batch
