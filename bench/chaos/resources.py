"""Probe: the host runs out of disk, of file descriptors or of Redis memory (hypothesis-drawn scarcity).

A gateway keeps its state on its own disk (`state: memory`: the usage ledger, the key store's SQLite
file, the batch store's files and progress) in front of simulated engines; then, for half as many
examples, one keeps it in a Redis the probe owns (the ledger and the key store's copy still on its
disk). Each example lowers the running gateway's own limits with `prlimit(2)`, or fills its Redis,
and sends requests while that holds:

- a full disk: `RLIMIT_FSIZE` 0, so every write that grows a file fails (`EFBIG`, as `ENOSPC` does
  on a full disk; Python ignores `SIGXFSZ`, so the write fails rather than the process ending);
- scarce descriptors: `RLIMIT_NOFILE` at the descriptors open now plus 0-24, so accepting a
  client, connecting to an engine or opening a file may fail with `EMFILE`;
- both at once;
- (with Redis) a full Redis: `maxmemory` at what it holds, `noeviction`: every write that needs
  memory is refused with an OOM error.

Then the limits are lifted and the next example begins. The requests, sent concurrently: chat
(streamed or not), Responses, `GET /v1/key`, a chat with a key made through the admin API, a key made,
a file uploaded and a batch made of it, a file listing. The gateway's log goes through a pipe (the
disk limit would silence a log file).

Targets:
- no request meets a bug: no 500, nothing of `UNEXPECTED_IN_LOG` and no traceback in the log but
  the first failure of a spell (`FIRST_FAILURES`: each logs one with its traceback, then a line a
  minute); an answer while resources are short is a success or a refusal in the API's error shape
  with a status and code that say so (`SHORT`): 503 `overloaded` (no descriptor for an engine
  connection), 507 `insufficient_storage` (the disk or Redis refused a file), 503
  `storage_unavailable` or `store_unavailable`;
- no engine is blamed for the gateway's own shortage: the log never says an endpoint failed or was
  ejected, and no request falls back to another model;
- connections closed without an answer only while descriptors are short (the event loop closes a
  connection it cannot accept), counted;
- exactly one ledger record per generating request that was answered, written once the disk is
  back (the ledger keeps what it could not write), none for one that never got in;
- afterwards every kind of request is served again with no restart, every batch made reaches a
  final state, and nothing is held (no lease, no request in flight).

Admin changes made while the audit log's disk is full are counted (`audit_gaps`), not failed: the
change is made before it is recorded, and its log line holds what the record would have
(docs/security.md).
"""

from __future__ import annotations

import os
import re
import resource
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.common import (
    ADMIN,
    KEY,
    MODEL,
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
from bench.chaos.surfaces import request
from tests.support.procs import Gateway, SimEngines, running, start_gateway, start_sim, static_pool

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
KINDS = ("chat", "stream", "responses", "key", "made", "keycreate", "upload", "files")
GENERATING = ("chat", "stream", "responses", "made")  # the requests the ledger records
SCARCITY = ("disk", "descriptors", "both")
# (status, code) a request may be refused with while a resource is short: the refusal says so
SHORT = {(503, "overloaded"), (507, "insufficient_storage"), (503, "storage_unavailable"), (503, "store_unavailable")}
# what the log says when an engine is blamed: the engines never fail in this probe
BLAMED = ("failed before the first byte", "ejected", "is not ready", "fallback")
# the one traceback a spell of failures may log: the ledger's first failed write
# (gateway/ledger/writer.py `_write_failed`), the batch runner's first failed tick or record
# (gateway/batch/runner.py) and the batch results log's first failed write (gateway/batch/result_log.py)
FIRST_FAILURES = (
    "usage ledger write to",
    "batch runner tick failed",
    "recording batch lines failed",
    "writing batch results failed",
)
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # a log record's first line
RECOVERY = 24
BOUNDARY = "chaosresourcesboundary"


class Stack:
    """One gateway with its state on its disk (or, with `redis`, in a Redis the probe owns, the key
    store's copy and the ledger still on its disk), in front of two simulated engines."""

    def __init__(self, workdir: Path, *, redis: bool = False) -> None:
        self.workdir = workdir
        self.sim: SimEngines | None = None
        self.redis: OwnRedis | None = None
        self.gateway: Gateway | None = None
        self.made = ""
        self.batches: list[str] = []
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            state: dict[str, Any] = {"backend": "memory", "keys_db": str(workdir / "keys.sqlite3")}
            if redis:
                self.redis = OwnRedis(workdir)
                state.update(backend="redis", redis_url=self.redis.url, key_prefix="resources")
            self.sim = start_sim(workdir, count=2, served_model_name=MODEL, time_scale=100.0)
            policy = policies(
                [{"scope": "key", "tpm": 100_000_000, "rpm": 1_000_000, "max_concurrent": 1000}],
                [{"scope": "tenant", "usd_per_day": 1e6}],
            )
            self.gateway = start_gateway(
                workdir / "gw",
                pools=[static_pool("llama", MODEL, self.sim.urls)],
                policies=policy,
                server={"admin_token": ADMIN},
                ledger={"dir": str(workdir / "usage"), "commit_interval_ms": 20},
                state=state,
                # room for every batch the probe makes: one that waits out a full disk stays active
                batch={"dir": str(workdir / "batch"), "tenant": {"max_active_batches": 1000, "max_files": 10_000}},
                predictor={"enabled": False},
                log_pipe=True,
            )
            status, _, raw = request(
                self.gateway.port, "POST", "/admin/keys", ADMIN_AUTH, orjson.dumps({"tenant": "bench", "id": "made"})
            )
            if status != 201:
                raise RuntimeError(f"POST /admin/keys: {status} {raw[:200]!r}")
            self.made = str(orjson.loads(raw)["secret"])
        except Exception:
            self.stop()
            raise

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def gw(self) -> Gateway:
        assert self.gateway is not None
        return self.gateway

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.sim is not None:
            self.sim.stop()
        if self.redis is not None:
            self.redis.stop()

    @property
    def scarcities(self) -> tuple[str, ...]:
        return (*SCARCITY, "redis_full") if self.redis is not None else SCARCITY


class Limits:
    """The gateway process's own limits (and its Redis's memory), lowered for an example and put
    back after it."""

    def __init__(self, pid: int, redis: OwnRedis | None = None) -> None:
        self.pid = pid
        self.fsize = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        self.nofile = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        self.redis = redis.client() if redis is not None else None

    def lower(self, scarcity: str, spare_descriptors: int) -> None:
        if scarcity == "redis_full" and self.redis is not None:  # every write that needs memory refused (OOM)
            used = int(self.redis.info("memory")["used_memory"])
            self.redis.config_set("maxmemory-policy", "noeviction")
            self.redis.config_set("maxmemory", used + 4096)
        if scarcity in ("disk", "both"):
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (0, self.fsize[1]))
        if scarcity in ("descriptors", "both"):
            open_now = len(os.listdir(f"/proc/{self.pid}/fd"))
            resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (open_now + spare_descriptors, self.nofile[1]))

    def lift(self) -> None:
        resource.prlimit(self.pid, resource.RLIMIT_FSIZE, self.fsize)
        resource.prlimit(self.pid, resource.RLIMIT_NOFILE, self.nofile)
        if self.redis is not None:
            self.redis.config_set("maxmemory", 0)


def upload_body(request_id: str) -> bytes:
    lines = batch_lines(request_id)
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + lines
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def send(stack: Stack, kind: str, request_id: str) -> tuple[int, bytes]:
    """One request of `kind` (`KINDS`); (status, body), status 0 when nothing answered."""
    port = stack.gw.port
    headers = {**AUTH, "x-request-id": request_id}
    messages = [{"role": "user", "content": "hi " + request_id[-6:]}]
    if kind in ("chat", "stream", "made"):
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": kind == "stream"}
        if kind == "made":
            headers["Authorization"] = f"Bearer {stack.made}"
        status, _, raw = request(port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
    elif kind == "responses":
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
        status, _, raw = request(port, "POST", "/v1/responses", headers, orjson.dumps(body))
    elif kind == "keycreate":
        body = {"tenant": "bench", "metadata": {"description": request_id}}
        status, _, raw = request(port, "POST", "/admin/keys", ADMIN_AUTH, orjson.dumps(body))
    elif kind == "upload":
        form = {"Authorization": f"Bearer {KEY}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        status, _, raw = request(port, "POST", "/v1/files", form, upload_body(request_id))
        if status == 200:
            file_id = str(orjson.loads(raw)["id"])
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            status, _, raw = request(port, "POST", "/v1/batches", AUTH, orjson.dumps(body))
            if status == 200:
                stack.batches.append(str(orjson.loads(raw)["id"]))
    elif kind == "files":
        status, _, raw = request(port, "GET", "/v1/files", AUTH)
    else:
        status, _, raw = request(port, "GET", "/v1/key", headers)
    return status, raw


def refusal(raw: bytes) -> tuple[str, str]:
    """(type, code) of an error answer in OpenAI's shape; ("", "") for anything else."""
    try:
        error = orjson.loads(raw)["error"]
        return str(error.get("type")), str(error.get("code"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "", ""


def batches_final(stack: Stack) -> int:
    """How many of the batches made are in a final state."""
    done = 0
    for batch_id in stack.batches:
        status, _, raw = request(stack.gw.port, "GET", f"/v1/batches/{batch_id}", AUTH)
        if status == 200 and orjson.loads(raw).get("status") in ("completed", "failed", "expired", "cancelled"):
            done += 1
    return done


def log_problems(log: str) -> tuple[int, int, int]:
    """(tracebacks other than a ledger spell's first, unexpected errors, lines blaming an engine)."""
    tracebacks = 0
    lines = log.splitlines()
    head = ""  # the first line of the record a line belongs to
    counted = False
    for line in lines:
        if RECORD.match(line):
            head, counted = line, False
        elif line.startswith("Traceback") and not counted:
            counted = True  # a chained exception's second traceback is the same record's
            tracebacks += not any(marker in head for marker in FIRST_FAILURES)
    blamed = sum(1 for line in lines if any(marker in line for marker in BLAMED))
    return tracebacks, unexpected_errors(log), blamed


def run(workdir: Path, *, examples: int = 120, seed: int | None = None) -> dict[str, Any]:
    """`examples` on a gateway keeping its state on its disk, then half as many on one keeping it in
    Redis (where a full Redis is drawn too); the two results summed."""
    results = []
    for redis in (False, True):
        stack = Stack(workdir / ("redis" if redis else "memory"), redis=redis)
        with running(stack):
            results.append(fuzz(stack, examples=examples // 2 if redis else examples, seed=seed))
    merged = _merged(*results)
    merged["examples"], merged["seed"] = examples, seed
    merged["redis_examples"] = examples // 2
    return merged


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two runs' results as one: counts summed, tallies merged, lists joined, verdicts all true."""
    out: dict[str, Any] = {}
    for key, value in a.items():
        other = b[key]
        if isinstance(value, bool):
            out[key] = value and other
        elif isinstance(value, (int, float)):
            out[key] = round(value + other, 1) if isinstance(value, float) else value + other
        elif key == "samples":
            out[key] = {**other, **value}
        elif isinstance(value, dict):
            out[key] = {k: value.get(k, 0) + other.get(k, 0) for k in sorted({*value, *other})}
        elif isinstance(value, list):
            out[key] = value + other
        else:
            out[key] = value
    return out


def fuzz(stack: Stack, *, examples: int, seed: int | None) -> dict[str, Any]:
    limits = Limits(stack.gw.proc.pid, stack.redis)
    sent: list[tuple[str, int]] = []  # (request id, status) of the generating requests
    statuses: dict[str, int] = {}
    samples: dict[str, str] = {}
    failures: list[str] = []
    unanswered = {"descriptors": 0, "other": 0}
    spells: dict[str, int] = {}
    started_s = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=len(KINDS))

    @fuzz_settings(examples, seed)
    @given(
        scarcity=st.sampled_from(stack.scarcities),
        spare=st.integers(0, 24),
        kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6),
    )
    def probe(scarcity: str, spare: int, kinds: list[str]) -> None:
        spells[scarcity] = spells.get(scarcity, 0) + 1
        ids = [f"resources-{kind}-{uuid.uuid4().hex[:12]}" for kind in kinds]
        limits.lower(scarcity, spare)
        try:
            answers = list(pool.map(lambda pair: send(stack, *pair), zip(kinds, ids, strict=True)))
        finally:
            limits.lift()
        for kind, request_id, (status, raw) in zip(kinds, ids, answers, strict=True):
            statuses[f"{kind} {status}"] = statuses.get(f"{kind} {status}", 0) + 1
            samples.setdefault(f"{kind} {status}", raw[:160].decode("utf-8", "replace"))
            if kind in GENERATING:
                sent.append((request_id, status))
            if status == 0:
                unanswered["descriptors" if scarcity in ("descriptors", "both") else "other"] += 1
                continue
            if status < 400 or status in (401, 429):
                continue
            _, code = refusal(raw)
            if (status, code) not in SHORT:
                failures.append(f"{kind} under {scarcity} (+{spare}): {status} {raw[:200]!r}")

    probe()
    pool.shutdown()
    seconds = time.monotonic() - started_s
    recovered = sum(
        send(stack, kind, f"resources-after-{kind}-{n}-{uuid.uuid4().hex[:8]}")[0] in (200, 201)
        for n in range(RECOVERY // 6)
        for kind in ("chat", "stream", "responses", "made", "keycreate", "upload")
    )
    final = until(lambda: batches_final(stack) == len(stack.batches), timeout_s=60)
    settled = until(lambda: held(stack.gw.url, ADMIN_AUTH) == (0, 0), timeout_s=30)
    leases, inflight = held(stack.gw.url, ADMIN_AUTH)
    answered = [request_id for request_id, status in sent if status]
    ledger = stack.workdir / "usage"
    # the ledger writes what it kept while the disk was full on its next try (a second later at most)
    until(lambda: set(answered) <= ledger_tally(ledger, "resources-")[0].keys(), timeout_s=15, interval_s=0.5)
    counts, negative = ledger_tally(ledger, "resources-")
    log = stack.gw.log()
    tracebacks, unexpected, blamed = log_problems(log)
    return {
        "examples": examples,
        "seed": seed,
        "spells": dict(sorted(spells.items())),
        "requests": sum(statuses.values()),
        "statuses": dict(sorted(statuses.items())),
        "samples": samples,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "unanswered_descriptors": unanswered["descriptors"],
        "unanswered_other": unanswered["other"],
        "unrecorded": sum(1 for r in answered if r not in counts),
        "recorded_twice": sum(1 for c in counts.values() if c > 1),
        "recorded_unanswered": sum(1 for r, status in sent if not status and r in counts),
        "negative_records": negative,
        "tracebacks_in_log": tracebacks,
        "unexpected_in_log": unexpected,
        "engines_blamed": blamed,
        # admin changes made while the audit log's disk was full: each said in one log line (docs/security.md)
        "audit_gaps": log.count("was made but could not be recorded"),
        "recovered": recovered,
        "recovery_requests": RECOVERY,
        "batches": len(stack.batches),
        "batches_final": batches_final(stack),
        "all_batches_final": final,
        "leases_left": leases,
        "inflight_left": inflight,
        "settled": settled,
        "alive": stack.gw.proc.poll() is None,
        "seconds": round(seconds, 1),
    }


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["unanswered_other"] == 0
        and r["tracebacks_in_log"] == 0
        and r["unexpected_in_log"] == 0
        and r["engines_blamed"] == 0
        and r["unrecorded"] == 0
        and r["recorded_twice"] == 0
        and r["negative_records"] == 0
        and r["recovered"] == r["recovery_requests"]
        and r["all_batches_final"]
        and r["leases_left"] == 0
        and r["inflight_left"] == 0
        and r["alive"]
    )


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    spells = ", ".join(f"{k}: {v}" for k, v in r["spells"].items())
    seeded = schema_fuzz.seeded(r)
    lines = [
        "## A host out of disk, file descriptors or Redis memory (hypothesis)",
        "",
        f"{r['examples']} examples{seeded} on a gateway keeping its ledger, key store and batch store on its disk, "
        f"then {r['redis_examples']} on one keeping them in Redis (the ledger and the key store's copy still on its "
        f"disk), {r['seconds']:g} s in all; each example lowers the running process's own limits with `prlimit(2)` "
        "(a full disk: `RLIMIT_FSIZE` 0; scarce descriptors: `RLIMIT_NOFILE` at those open plus 0-24; both) or "
        "fills its Redis (`maxmemory` at what it holds: every write that needs memory refused) "
        f"({spells}), sends 1-6 requests at once (chat streamed or not, Responses, `GET /v1/key`, a chat with a "
        "key made through the admin API, a key made, a file uploaded and a batch made of it, the file listing) "
        f"and lifts them. {r['requests']} requests; answers by kind and status: {statuses}.",
        "",
        "| met a bug | closed unanswered (descriptors short / otherwise) | tracebacks or unexpected errors "
        "in the log | engines blamed | not recorded | recorded twice | recorded, never answered | "
        "served after the limits lifted | batches final | leases / in flight left | alive |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        f"| {r['failures']} | {r['unanswered_descriptors']} / {r['unanswered_other']} | "
        f"{r['tracebacks_in_log'] + r['unexpected_in_log']} | {r['engines_blamed']} | {r['unrecorded']} | "
        f"{r['recorded_twice']} | {r['recorded_unanswered']} | {r['recovered']} of {r['recovery_requests']} | "
        f"{r['batches_final']} of {r['batches']} | {r['leases_left']} / {r['inflight_left']} | "
        f"{'yes' if r['alive'] else 'no'} |",
        "",
        f"Admin changes made while the audit log's disk was full, each named in one log line instead of a record: "
        f"{r['audit_gaps']} (the change is made before it is recorded; docs/security.md).",
        "",
        "Targets (a request answered while a resource is short is served or refused in the API's error shape "
        "with a status and code that say so: 503 `overloaded`, 507 `insufficient_storage`, 503 "
        "`storage_unavailable` or `store_unavailable` (a full Redis also moves the limits to the replica's own, "
        "as its outage does); a connection closed unanswered only while descriptors are short; no traceback but "
        "the first failure of a spell (the ledger's, the batch runner's and results log's); no engine blamed for "
        "the gateway's own "
        "shortage; one record per answered generating request, written once the disk is back; afterwards every "
        "kind served with no restart, every batch final, nothing held): "
        f"{'met' if met(r) else '**missed**'}.",
        "",
    ]
    return lines + examples_block(r["failure_examples"])
