"""Stream entries round-trip, and a malformed one is refused whole (it comes from a shared store)."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.replicas.wire import Batch, MalformedBatch, decode, encode


def test_round_trip() -> None:
    batch = Batch("gw0", 7, [("p/e0", 3, 120, 4000)], [("p/e0", [1, 2**64 - 1], "p\x00s1"), ("p/e1", [], None)])
    assert decode(encode(batch)) == batch
    no_report = Batch("gw1", 0, None, [])
    assert decode(encode(no_report)).loads is None
    assert decode(encode(no_report)).tenants is None


def test_tenant_activity_round_trips() -> None:
    rows = [("llama", "B", 2, 2.0, 3, 0, 7, 1), ("llama", "A", 2, 1.0, 9, 40, 49, 0)]
    batch = Batch("gw0", 1, [], [], rows)
    assert decode(encode(batch)) == batch
    # a row without its claims (a replica of the version before) reads as none claimed
    older = msgpack.packb({"r": "gw1", "q": 1, "t": [["llama", "B", 2, 2.0, 3, 0, 7]]})
    assert decode(older).tenants == [("llama", "B", 2, 2.0, 3, 0, 7, 0)]
    assert decode(encode(Batch("gw0", 2, [], [], []))).tenants == []  # reported: nobody active


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2],
        {"r": "gw", "q": "1"},
        {"r": 3, "q": 1},
        {"r": "gw", "q": 1, "l": [["e", -1, 0, 0]]},
        {"r": "gw", "q": 1, "l": [["e", 1, 0]]},
        {"r": "gw", "q": 1, "l": "e"},
        {"r": "gw", "q": 1, "d": [["e", [-1], None]]},
        {"r": "gw", "q": 1, "d": [["e", ["k"], None]]},
        {"r": "gw", "q": 1, "d": [["e", [1], 5]]},
        {"r": "gw", "q": 1, "d": [[1, [1], None]]},
        {"r": "gw", "q": 1, "t": "B"},
        {"r": "gw", "q": 1, "t": [["p", "B", 2, 1.0, 1, 0]]},
        {"r": "gw", "q": 1, "t": [["p", "B", 9, 1.0, 1, 0, 1]]},
        {"r": "gw", "q": 1, "t": [["p", "B", 2, 0, 1, 0, 1]]},
        {"r": "gw", "q": 1, "t": [["p", "B", 2, 1.0, -1, 0, 1]]},
        {"r": "gw", "q": 1, "t": [["p", 7, 2, 1.0, 1, 0, 1]]},
        {"r": "gw", "q": 1, "t": [["p", "B", 2, 1.0, 1, 0, 1, -1]]},
        {"r": "gw", "q": 1, "t": [["p", "B", 2, 1.0, 1, 0, 1, 0, 0]]},
    ],
    ids=[
        "not-a-map",
        "sequence-type",
        "replica-type",
        "negative-load",
        "short-load",
        "loads-type",
        "negative-key",
        "key-type",
        "session-type",
        "endpoint-type",
        "tenants-type",
        "short-tenant",
        "band-out-of-range",
        "weight-not-positive",
        "negative-inflight",
        "tenant-type",
        "negative-claimed",
        "long-tenant",
    ],
)
def test_malformed(doc: object) -> None:
    with pytest.raises(MalformedBatch):
        decode(msgpack.packb(doc))


def test_garbage_bytes() -> None:
    with pytest.raises(MalformedBatch):
        decode(b"\xc1\xc1\xc1")


def test_tool_affinity_notes_and_gaps_round_trip() -> None:
    batch = Batch("gw0", 3, None, [], None, [("acme", "run-1", "p/e0", 5200, 12)], [("acme", "run-0", 7400)])
    assert decode(encode(batch)) == batch
    assert decode(encode(Batch("gw0", 4, None, []))).tool_notes == []


@pytest.mark.parametrize(
    "doc",
    [
        {"r": "gw", "q": 1, "n": "x"},
        {"r": "gw", "q": 1, "n": [["t", "p", "e", 1]]},
        {"r": "gw", "q": 1, "n": [["t", "p", "e", -1, 0]]},
        {"r": "gw", "q": 1, "n": [["t", 5, "e", 1, 0]]},
        {"r": "gw", "q": 1, "n": [["t", "p", "", 1, 0]]},
        {"r": "gw", "q": 1, "n": [["t", "p" * 2000, "e", 1, 0]]},
        {"r": "gw", "q": 1, "g": [["t", "p", 1.5]]},
        {"r": "gw", "q": 1, "g": [["t", "p", True]]},
    ],
    ids=[
        "notes-type",
        "short-note",
        "negative-tokens",
        "program-type",
        "empty-endpoint",
        "long-program",
        "gap-float",
        "gap-bool",
    ],
)
def test_malformed_tool_rows_refuse_the_batch(doc: object) -> None:
    with pytest.raises(MalformedBatch):
        decode(msgpack.packb(doc))


def test_program_activity_round_trips_and_a_malformed_row_refuses_the_batch() -> None:
    rows = [("llama", "t", "wide", 6, 30), ("llama", "t", "small", 0, 0)]
    batch = Batch("gw0", 3, [], [], [], programs=rows)
    assert decode(encode(batch)) == batch
    assert decode(encode(Batch("gw0", 4, [], []))).programs is None  # not shared: nothing replaced
    for row in (["llama", "t", "", 1, 0], ["llama", "t", "x", -1, 0], ["llama", "t", "x", True, 0], ["llama", "t"]):
        with pytest.raises(MalformedBatch):
            decode(msgpack.packb({"r": "gw1", "q": 1, "p": [row]}))


_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=5), st.binary(max_size=5)
)
_VALUES = st.recursive(
    _LEAVES, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=3), c, max_size=4), max_leaves=20
)
_DOCS = st.fixed_dictionaries(
    {"r": st.one_of(st.text(max_size=4), _VALUES), "q": st.one_of(st.integers(-5, 5), _VALUES)},
    optional={field: _VALUES for field in "ldtpng"},
)


@settings(max_examples=1000, database=None, deadline=None)
@given(_DOCS)
def test_any_document_is_a_batch_or_malformed_never_an_error(doc: dict[str, object]) -> None:
    """An entry of the shared stream is read by every replica's reader, whose loop ends on anything but
    `MalformedBatch`: a field of any type (dispatches as a number, a weight of infinity) refuses the
    entry, nothing else."""
    try:
        batch = decode(msgpack.packb(doc, use_bin_type=True))
    except MalformedBatch:
        return
    assert all(math.isfinite(row[3]) for row in batch.tenants or ())


@pytest.mark.parametrize(
    "doc", [{"r": "gw1", "q": 1, "d": 10}, {"r": "gw1", "q": 1, "t": [["p", "t", 2, 1e309, 1, 0, 1]]}]
)
def test_dispatches_that_are_no_list_and_an_infinite_weight_refuse_the_batch(doc: object) -> None:
    with pytest.raises(MalformedBatch):
        decode(msgpack.packb(doc))
