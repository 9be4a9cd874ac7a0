"""The stream entries replicas exchange: one msgpack map per batch, under field `b` (field `r` holds
the publisher's id as well, so a reader skips its own entries without decoding them).

    {"r": replica id, "q": sequence number,
     "l": [[endpoint id, requests, prefill tokens, decode tokens], ...]   # present: a full load report
     "d": [[endpoint id, [block key, ...], session or None], ...]         # dispatches since the last batch
     "t": [[pool, tenant, band, weight, in flight, waiting, peak, claimed], ...],  # with "l": its active tenants
     "p": [[pool, tenant, program, in flight, waiting], ...],             # with "l": its active programs
     "n": [[tenant, program, endpoint id, prefix tokens, age ms], ...],   # tool-call answers since the last batch
     "g": [[tenant, program, gap ms], ...]}                                # returns from a tool call dispatched

A load report is the replica's whole share on every shared endpoint (an endpoint left out has none
of its requests), so a report replaces the previous one and nothing accumulates when one is lost;
the same holds for its tenants' activity (`gateway.flow.activity`: what the slot reserve reads;
`claimed`, slots preemption cut for the tenant and not yet taken, may be left out: 0), and for its
programs' activity (`gateway.flow.activity`: what the program slot reserve reads; a batch
without "p" from a replica that never shares it leaves nothing behind).
A tool-call note carries its age when published (ms on the publisher's clock), not a time: replicas'
clocks need not agree, and the reader dates it on its own clock less that age (the stream's transit,
milliseconds, is not counted). Decoding checks every type: an entry is read from a store other
processes write, and a malformed one is dropped whole, never half applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeGuard

import msgpack

from policies.flow.order import BANDS

Load = tuple[str, int, int, int]
Dispatch = tuple[str, list[int], str | None]
# pool, tenant, band, weight, in flight, waiting, peak, claimed
TenantLoad = tuple[str, str, int, float, int, int, int, int]
ProgramLoad = tuple[str, str, str, int, int]  # pool, tenant, program, in flight, waiting
ToolNote = tuple[str, str, str, int, int]  # tenant, program, endpoint id, prefix tokens, age ms
ToolGap = tuple[str, str, int]  # tenant, program, gap ms

_MASK64 = (1 << 64) - 1
_MAX_TEXT = 1024  # a tenant, program or endpoint id longer than this is not one the gateway wrote
_MAX_BAND = len(BANDS) - 1


@dataclass(slots=True)
class Batch:
    replica: str
    sequence: int
    loads: list[Load] | None = None  # None: no load report in this batch
    dispatches: list[Dispatch] = field(default_factory=list)
    tenants: list[TenantLoad] | None = None  # None: no activity report in this batch
    tool_notes: list[ToolNote] = field(default_factory=list)  # tool-boundary affinity (routing/tool_affinity.py)
    tool_gaps: list[ToolGap] = field(default_factory=list)
    programs: list[ProgramLoad] | None = None  # None: no programs' report in this batch


def encode(batch: Batch) -> bytes:
    doc: dict[str, object] = {"r": batch.replica, "q": batch.sequence}
    if batch.loads is not None:
        doc["l"] = [list(load) for load in batch.loads]
    if batch.dispatches:
        doc["d"] = [[e, keys, s] for e, keys, s in batch.dispatches]
    if batch.tenants is not None:
        doc["t"] = [list(row) for row in batch.tenants]
    if batch.programs is not None:
        doc["p"] = [list(row) for row in batch.programs]
    if batch.tool_notes:
        doc["n"] = [list(note) for note in batch.tool_notes]
    if batch.tool_gaps:
        doc["g"] = [list(gap) for gap in batch.tool_gaps]
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
    for item in _rows(doc.get("d"), "dispatches", 3):
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str):
            raise MalformedBatch("dispatch")
        keys, session = item[1], item[2]
        if not isinstance(keys, list) or not all(isinstance(k, int) and 0 <= k <= _MASK64 for k in keys):
            raise MalformedBatch("keys")
        if session is not None and not isinstance(session, str):
            raise MalformedBatch("session")
        batch.dispatches.append((item[0], keys, session))
    if "t" in doc:
        batch.tenants = _tenants(doc["t"])
    if "p" in doc:
        batch.programs = []
        for item in _rows(doc["p"], "programs", 5):
            pool, tenant, program, inflight, waiting = item
            if not (_text(pool) and _text(tenant) and _text(program) and _count(inflight) and _count(waiting)):
                raise MalformedBatch("program")
            batch.programs.append((pool, tenant, program, inflight, waiting))
    for item in _rows(doc.get("n"), "tool notes", 5):
        tenant, program, endpoint_id, tokens, age = item
        if not (_text(tenant) and _text(program) and _text(endpoint_id) and _count(tokens) and _count(age)):
            raise MalformedBatch("tool note")
        batch.tool_notes.append((tenant, program, endpoint_id, tokens, age))
    for item in _rows(doc.get("g"), "tool gaps", 3):
        tenant, program, gap = item
        if not (_text(tenant) and _text(program) and _count(gap)):
            raise MalformedBatch("tool gap")
        batch.tool_gaps.append((tenant, program, gap))
    return batch


def _rows(rows: object, what: str, width: int) -> list[list[object]]:
    if rows is None:
        return []
    if not isinstance(rows, list) or not all(isinstance(row, list) and len(row) == width for row in rows):
        raise MalformedBatch(what)
    return rows


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MASK64


def _tenants(rows: object) -> list[TenantLoad]:
    if not isinstance(rows, list):
        raise MalformedBatch("tenants")
    out: list[TenantLoad] = []
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) not in (7, 8)
            or not isinstance(row[0], str)
            or not isinstance(row[1], str)
        ):
            raise MalformedBatch("tenant")
        band, weight, counts = row[2], row[3], row[4:]
        if not isinstance(band, int) or not 0 <= band <= _MAX_BAND:
            raise MalformedBatch("tenant band")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise MalformedBatch("tenant weight")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
            raise MalformedBatch("tenant counts")
        claimed = counts[3] if len(counts) > 3 else 0
        out.append((row[0], row[1], band, float(weight), counts[0], counts[1], counts[2], claimed))
    return out
