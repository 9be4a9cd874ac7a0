"""Probe: the shared state holds anything (hypothesis-drawn corruption of every Redis key).

Two gateways share one Redis (limits, budgets, the response store, the replicas' stream, flow
control's counts, the console's activity), as replicas do. Redis is the gateway's own store, but what
it holds is input all the same: a replica of another version during a rolling upgrade, an operator's
hand edit, a restore from an older snapshot or a bug in one replica writes what the others then read.
So between requests the probe corrupts keys the gateways wrote, drawn from a fresh `SCAN` of the
prefix: deleted, replaced by a value of another type, a hash field or a string set to garbage (not
numbers, NaN, infinities, ±1e308, JSON of the wrong shape, cut bytes), members with infinite scores,
stream entries with fields of any bytes. Clients meanwhile send chat requests (streamed or not, with a
program), Responses requests continuing stored answers, reads of stored answers, `GET /v1/key`, a
key made through the admin API (its requests, the key listing, writes to it), and files uploaded and
batches made of them (read and listed while both gateways' runners claim their lines), alternating
between the gateways.

Targets:
- no request meets a bug: no 500, no closed socket, nothing of `UNEXPECTED_IN_LOG` in either log;
- exactly one ledger record per generating request, none negative;
- afterwards, with the corrupted keys deleted (an operator's repair: no restart), both gateways serve
  every request again, hold nothing (no lease, no request in flight), and still read each other's
  reports on the replicas' stream (a reader that died on an entry would stop folding its peer's load).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import orjson
import redis
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.common import (
    ADMIN,
    KEY,
    MODEL,
    PREFIX,
    OwnRedis,
    batch_lines,
    examples_block,
    fuzz_settings,
    held,
    ledger_tally,
    policies,
    unexpected_errors,
    until,
)
from bench.chaos.fuzz import json_values
from bench.chaos.surfaces import request
from tests.support.procs import Gateway, SimEngines, running, start_gateway, start_sim, static_pool

NUMBERS = (b"", b"nan", b"NaN", b"inf", b"-inf", b"-1", b"-1e308", b"1e308", b"9" * 40, b"0x10", b"1.5.2", b"\xff\xfe")
SCORES = (math.inf, -math.inf, 1e308, -1e308, 0.0, -1.0, 1.8e19)
_JSON = st.builds(lambda v: json.dumps(v).encode(), json_values)
GARBAGE = st.one_of(st.sampled_from(NUMBERS), st.binary(max_size=48), _JSON)
PICK = st.integers(0, 2**16)
ACTIONS = ("delete", "retype", "garble", "garble", "garble")
TYPES = ("string", "hash", "list", "set", "zset", "stream")
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
GENERATING = ("chat", "stream", "responses", "made")  # the requests that are recorded


@dataclass(frozen=True)
class Corruption:
    """One drawn corruption: every choice is drawn whatever the key turns out to hold (hypothesis
    needs the draws not to depend on outside state), and `apply` uses the ones that fit."""

    pick: int  # which key, by index into the keys scanned last
    action: str
    kind: str  # the type a `retype` (or a key gone meanwhile) gets
    value: bytes
    field: int  # which hash field, by index
    score: float
    entry: dict[bytes, bytes]  # a stream entry's fields

    def apply(self, client: redis.Redis, keys: list[bytes]) -> tuple[bytes, str]:
        try:
            return self._apply(client, keys)
        except redis.ResponseError:  # a gateway wrote the key anew between the probe's TYPE and its write
            key = self._key(keys)
            client.delete(key)
            client.set(key, self.value)
            return key, f"string {key!r} <- {self.value[:40]!r}"

    def _key(self, keys: list[bytes]) -> bytes:
        families = sorted({family(k) for k in keys})
        chosen = families[self.pick % len(families)]
        members = [k for k in keys if family(k) == chosen]
        return members[self.field % len(members)]

    def _apply(self, client: redis.Redis, keys: list[bytes]) -> tuple[bytes, str]:
        """Corrupt one of `keys` (a family drawn first, so the one key of a kind is hit as often as the
        many response entries); (the key, a line saying what was done)."""
        key, value = self._key(keys), self.value
        if self.action == "delete":
            client.delete(key)
            return key, f"DEL {key!r}"
        found = client.type(key)
        actual = found.decode() if isinstance(found, bytes) else str(found)
        if self.action == "retype" or actual == "none":
            client.delete(key)
            actual = self.kind
        if actual == "string":
            client.set(key, value, keepttl=True)
        elif actual == "hash":
            fields = [*sorted(client.hkeys(key)), b"x", b""]
            field = fields[self.field % len(fields)]
            client.hset(key, field, value)
            return key, f"HSET {key!r} {field!r} {value[:40]!r}"
        elif actual == "list":
            client.rpush(key, value)
        elif actual == "set":
            client.sadd(key, value)
        elif actual == "zset":
            client.zadd(key, {value or b"m": self.score})
        elif actual == "stream":
            client.xadd(key, self.entry)  # type: ignore[arg-type]
            return key, f"XADD {key!r} {self.entry!r}"[:200]
        return key, f"{actual} {key!r} <- {value[:40]!r}"


def family(key: bytes) -> str:
    """A key with its ids (the segments with digits: response ids, replica ids, bands) as `*`: what
    kind of state it is."""
    text = key.decode("utf-8", "replace")
    return ":".join(
        "*" if segment.startswith("resp_") or any(c.isdigit() for c in segment) else segment
        for segment in text.split(":")
    )


corruptions = st.builds(
    Corruption,
    pick=PICK,
    action=st.sampled_from(ACTIONS),
    kind=st.sampled_from(TYPES),
    value=GARBAGE,
    field=PICK,
    score=st.sampled_from(SCORES),
    entry=st.dictionaries(st.sampled_from((b"r", b"d", b"v", b"b", b"x")), GARBAGE, min_size=1),
)


TRANSIENT = tuple(
    ("{" + PREFIX + "}:" + name).encode()
    for name in (
        "tickets",
        "voided",
        "c:key|max_concurrent|bench",
        "flow:programs:bench",
        "flow:programs:bench:at",
        "runs",
        "runs:by",
    )
)


class Pair:
    """Two gateways on one Redis and the same simulated engines: the replicas this probe corrupts."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis = OwnRedis(workdir)
        self.sim: SimEngines | None = None
        self.gateways: list[Gateway] = []
        self.made = ""  # the secret of a key made through the admin API
        self.stored: list[str] = []  # the newest stored responses' ids
        self.files: list[str] = []  # the newest uploaded files' and batches' ids
        self.batches: list[str] = []
        self.batch_calls = 0
        try:
            self.sim = start_sim(workdir, count=2, served_model_name=MODEL, time_scale=100.0)
            policy = policies(
                [{"scope": "key", "tpm": 100_000_000, "rpm": 1_000_000, "max_concurrent": 1000}],
                [{"scope": "tenant", "usd_per_day": 1e6}, {"scope": "key", "usd_per_day": 1e6}],
            )
            for n in range(2):
                self.gateways.append(
                    start_gateway(
                        workdir / f"gw{n}",
                        pools=[static_pool("llama", MODEL, self.sim.urls)],
                        policies=policy,
                        server={"admin_token": ADMIN},
                        state={"backend": "redis", "redis_url": self.redis.url, "key_prefix": PREFIX},
                        ledger={"dir": str(workdir / f"usage{n}"), "commit_interval_ms": 20},
                        predictor={"enabled": False},
                    )
                )
            status, _, raw = request(
                self.gateways[0].port,
                "POST",
                "/admin/keys",
                {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
                orjson.dumps({"tenant": "bench", "id": "made", "limits": {"tpm": 10_000_000}}),
            )
            if status != 201:
                raise RuntimeError(f"POST /admin/keys: {status} {raw[:200]!r}")
            self.made = str(orjson.loads(raw)["secret"])
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        if self.sim is not None:
            self.sim.stop()
        self.redis.stop()

    def keys(self) -> list[bytes]:
        """The keys under the prefix now, and those that live only while a request is in flight or
        only in some policies (tickets, leases, voided tickets, programs' service, agent runs): a
        corruption of one that is absent creates it, of another type or with garbage."""
        client = self.redis.client()
        return sorted({*client.scan_iter(count=1000), *TRANSIENT})


def send(pair: Pair, gateway: Gateway, kind: str, request_id: str) -> tuple[int, bytes]:
    """One request of `kind` (see `KINDS`); (status, body) with status 0 when nothing answered."""
    stored, made = pair.stored, pair.made
    headers = {**AUTH, "x-request-id": request_id}
    messages = [{"role": "user", "content": "hi " + request_id[-6:]}]
    if kind in ("chat", "stream"):
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": kind == "stream"}
        headers["x-tokenway-program"] = "program-" + request_id[-1]
        status, _, raw = request(gateway.port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
    elif kind == "responses":
        body = {"model": MODEL, "input": "go on", "max_output_tokens": 4, "store": True}
        if stored:
            body["previous_response_id"] = stored[-1]
        status, _, raw = request(gateway.port, "POST", "/v1/responses", headers, orjson.dumps(body))
        if status == 200:
            stored.append(str(orjson.loads(raw).get("id")))
            del stored[:-8]
    elif kind == "read":
        path = f"/v1/responses/{stored[-1]}" if stored else "/v1/responses/resp_none"
        status, _, raw = request(gateway.port, "GET", path, headers)
    elif kind == "made":  # a key made through the admin API: its record lives in Redis
        headers["Authorization"] = f"Bearer {made}"
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        status, _, raw = request(gateway.port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
    elif kind == "keys":
        status, _, raw = request(gateway.port, "GET", "/admin/keys?spend=1", {"Authorization": f"Bearer {ADMIN}"})
    elif kind == "batch":
        status, raw = batch_call(pair, gateway, request_id)
    elif kind == "keywrite":  # a write of the key store: a document, the version counter, an announcement
        admin = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
        body = {"metadata": {"description": request_id}}
        status, _, raw = request(gateway.port, "PATCH", "/admin/keys/made", admin, orjson.dumps(body))
    else:
        status, _, raw = request(gateway.port, "GET", "/v1/key", headers)
    return status, raw


KINDS = ("chat", "stream", "responses", "read", "key", "made", "keys", "keywrite", "batch")


def batch_call(pair: Pair, gateway: Gateway, request_id: str) -> tuple[int, bytes]:
    """One Files or Batch API call, in turn: a file uploaded and a batch made of it (the runners of
    both gateways then claim its lines through Redis), the newest batch read, the batches listed, the
    newest file's content read."""
    pair.batch_calls += 1
    step = pair.batch_calls % 4
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        return _batch_step(pair, client, step, request_id)


def _batch_step(pair: Pair, client: openai.OpenAI, step: int, request_id: str) -> tuple[int, bytes]:
    try:
        if step == 0 or not pair.batches:
            lines = batch_lines(request_id)
            file = client.files.create(file=("in.jsonl", lines), purpose="batch")
            pair.files = [*pair.files[-7:], file.id]
            batch = client.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            pair.batches = [*pair.batches[-7:], batch.id]
            return 200, batch.id.encode()
        if step == 1:
            return 200, client.batches.retrieve(pair.batches[-1]).model_dump_json().encode()
        if step == 2:
            return 200, orjson.dumps([b.id for b in client.batches.list(limit=20)])
        return 200, client.files.content(pair.files[-1]).content[:200]
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.content
    except openai.APIConnectionError as exc:
        return 0, f"{step}: {exc!r} {exc.__cause__!r}".encode()


def peers_seen(gateway: Gateway) -> int:
    """How many other replicas this gateway heard from in the last `PEER_FRESH_S` on the replicas'
    stream (/admin/replicas): a reader that died on an entry lets its peers' ages grow."""
    status, _, raw = request(gateway.port, "GET", "/admin/replicas", {"Authorization": f"Bearer {ADMIN}"})
    if status != 200:
        return -1
    peers = orjson.loads(raw).get("peers") or {}
    return sum(1 for peer in peers.values() if float(peer.get("age_s", math.inf)) < PEER_FRESH_S)


PEER_FRESH_S = 5.0


def breaker_trips(gateway: Gateway) -> int:
    """Times the gateway's limiter gave up on Redis (/admin/status): a corrupted key must cost that
    key its state, not move every tenant's limits to local ones."""
    status, _, raw = request(gateway.port, "GET", "/admin/status", {"Authorization": f"Bearer {ADMIN}"})
    return int(orjson.loads(raw)["admission"].get("breaker_trips", 0)) if status == 200 else -1


def serve_again(pair: Pair, tag: str) -> int:
    """How many of `RECOVERY` requests (each kind, alternating gateways) are answered as the state says:
    served (200), or refused by a limit (429) where a corrupted count that is still a number (a spend
    of 1e308) reads as what it says until its key expires: the shared store's truth, not a failure."""
    kinds = ("chat", "stream", "responses", "key")
    statuses = [
        send(pair, pair.gateways[n % 2], kind, f"state-{tag}-{n}-{uuid.uuid4().hex[:8]}")[0]
        for n in range(RECOVERY // len(kinds))
        for kind in kinds
    ]
    return sum(status in (200, 429) for status in statuses)


RECOVERY = 40


def run(workdir: Path, *, examples: int = 600, seed: int | None = None) -> dict[str, Any]:
    pair = Pair(workdir)
    with running(pair):
        return fuzz(pair, examples=examples, seed=seed)


def fuzz(pair: Pair, *, examples: int, seed: int | None) -> dict[str, Any]:
    client = pair.redis.client()
    sent: list[str] = []
    statuses: dict[int, int] = {}
    samples: dict[str, str] = {}  # an answer of each kind and status, for the reader
    failures: list[str] = []
    corrupted: set[bytes] = set()
    actions: list[str] = []
    for n in range(10):  # every kind of request once per gateway: the keys they write exist
        for kind in KINDS:
            send(pair, pair.gateways[n % 2], kind, f"state-warm-{n}-{uuid.uuid4().hex[:8]}")
    keys = pair.keys()
    drawn = [0]  # examples so far
    seen = {family(k) for k in keys}  # every kind of key a scan found
    started_s = time.monotonic()

    @fuzz_settings(examples, seed)
    @given(st.data())
    def probe(data: st.DataObject) -> None:
        nonlocal keys
        drawn[0] += 1
        if drawn[0] % 10 == 0:  # the gateways write new keys as they go
            keys = pair.keys() or keys
            seen.update(family(k) for k in keys)
        for corruption in data.draw(st.lists(corruptions, min_size=1, max_size=3)):
            key, done = corruption.apply(client, keys)
            actions.append(done)
            corrupted.add(key)
        for _ in range(data.draw(st.integers(1, 3))):
            kind = data.draw(st.sampled_from(KINDS))
            gateway = pair.gateways[data.draw(st.integers(0, 1))]
            request_id = f"state-fuzz-{kind}-{uuid.uuid4().hex[:12]}"
            status, raw = send(pair, gateway, kind, request_id)
            if kind in GENERATING:
                sent.append(request_id)
            statuses[status] = statuses.get(status, 0) + 1
            samples.setdefault(f"{kind} {status}", raw[:200].decode("utf-8", "replace"))
            if status in (0, 500, 502, 503):  # Redis answers throughout: a 503 is a failure met, not an outage
                failures.append(f"{kind}: {status} {raw[:200]!r} after {actions[-3:]}")

    probe()
    seconds = time.monotonic() - started_s
    pair.stored.clear()  # continued from here on: new conversations
    healed = serve_again(pair, "healed")  # as the fuzz left the keys
    time.sleep(PEER_FRESH_S / 2)  # a report from each, over the stream as the fuzz left it
    healed_peers = [peers_seen(g) for g in pair.gateways]
    trips = sum(breaker_trips(g) for g in pair.gateways)
    if corrupted:
        client.delete(*corrupted)  # the operator's repair
    pair.stored.clear()  # the conversations' entries went with it
    recovered = serve_again(pair, "after")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    settled = until(lambda: all(held(g.url, admin) == (0, 0) for g in pair.gateways), timeout_s=30)
    left = [held(g.url, admin) for g in pair.gateways]
    peers = [peers_seen(g) for g in pair.gateways]
    counts: dict[str, int] = {}
    negative = 0
    for n in range(2):
        part, neg = ledger_tally(pair.workdir / f"usage{n}", "state-fuzz-")
        negative += neg
        for request_id, count in part.items():
            counts[request_id] = counts.get(request_id, 0) + count
    return {
        "examples": examples,
        "seed": seed,
        "requests": sum(statuses.values()),
        "corruptions": len(actions),
        "keys_corrupted": len(corrupted),
        "families": sorted(seen),
        "families_corrupted": sorted({family(k) for k in corrupted}),
        "statuses": dict(sorted(statuses.items())),
        "samples": samples,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "unrecorded": sum(1 for r in sent if r not in counts),
        "recorded_twice": sum(1 for c in counts.values() if c > 1),
        "negative_records": negative,
        "unexpected_in_log": sum(unexpected_errors(g.log()) for g in pair.gateways),
        "tracebacks_in_log": sum(g.log().count("Traceback") for g in pair.gateways),
        "healed": healed,
        "healed_peers": healed_peers,
        "breaker_trips": trips,
        "recovered": recovered,
        "recovery_requests": RECOVERY,
        "leases_left": sum(lease for lease, _ in left),
        "inflight_left": sum(inflight for _, inflight in left),
        "peers_seen": peers,
        "settled": settled,
        "seconds": round(seconds, 1),
    }


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["unexpected_in_log"] == 0
        and r["tracebacks_in_log"] == 0
        and r["unrecorded"] == 0
        and r["recorded_twice"] == 0
        and r["negative_records"] == 0
        and r["recovered"] == r["recovery_requests"]
        and r["healed"] == r["recovery_requests"]
        and r["breaker_trips"] == 0
        and all(p >= 1 for p in r["healed_peers"])
        and r["leases_left"] == 0
        and r["inflight_left"] == 0
        and all(p >= 1 for p in r["peers_seen"])
    )


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    seeded = schema_fuzz.seeded(r)
    families = ", ".join(f"`{f}`" for f in r["families"])
    lines = [
        "## Shared state that holds anything (hypothesis)",
        "",
        f"{r['examples']} examples{seeded} in {r['seconds']:g} s: two gateways on one Redis; before each example's "
        f"requests 1-3 keys under the prefix are corrupted ({r['corruptions']} corruptions of {r['keys_corrupted']} "
        "keys: deleted, replaced by another type, hash fields and strings set to garbage (text, NaN, infinities, "
        "±1e308, hex, JSON of any shape), infinite scores, stream entries of any bytes), a kind of key drawn first: "
        f"{len(r['families_corrupted'])} of the {len(r['families'])} kinds the gateways use were corrupted "
        f"({families}). {r['requests']} requests (chat streamed or not with a program, Responses continuing "
        "stored answers, reads of stored answers, `GET /v1/key`, a key made through the admin API, the key listing "
        "and writes to that key, files uploaded and batches made of them, read and listed while both gateways' "
        f"runners claim their lines). Answers by status: {statuses}.",
        "",
        "| met a bug (500, 503 or no answer) | unexpected errors or tracebacks in the logs | not recorded | "
        "recorded twice | "
        "negative records | limiter breaker trips | answered with the garbage left | answered after the repair | "
        "leases left | in flight left | peers seen (left, repaired) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {r['failures']} | {r['unexpected_in_log'] + r['tracebacks_in_log']} | {r['unrecorded']} | "
        f"{r['recorded_twice']} | "
        f"{r['negative_records']} | {r['breaker_trips']} | {r['healed']} of {r['recovery_requests']} | "
        f"{r['recovered']} of {r['recovery_requests']} | {r['leases_left']} | {r['inflight_left']} | "
        f"{r['healed_peers']}, {r['peers_seen']} |",
        "",
        "Targets (no request meets a bug and no task logs one; every generating request recorded exactly "
        "once, none negative; no corrupted key trips the limiter's breaker, which would move every tenant to "
        "local limits; with the garbage left in place and again after the corrupted keys are deleted, every "
        "request answered as the state says (served, or refused by a limit a corrupted count still reads as "
        "spent) with no restart, and each gateway reading the other's reports; nothing held): "
        f"{'met' if met(r) else '**missed**'}.",
        "",
    ]
    return lines + examples_block(r["failure_examples"])
