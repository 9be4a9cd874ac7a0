"""Probe: what the disk holds is input too (hypothesis-drawn damage to the gateway's own files).

One gateway (`state: memory`) keeps its state in local files and reads them back at start-up or while
serving: the usage ledger (`ledger.dir`, JSON lines, read back for `/admin/usage`, tenants' spend
and programs), the audit log (`ledger.audit.dir`, read back for `/admin/audit`), the key store
(`state.keys_db`, SQLite: keys and tenants made through the admin API), and the batch store
(`batch.dir`: file records, uploaded bytes and their line index, batch records, per-line result
logs read back at start-up). A disk that fills, an operator's hand edit, a restore from an older
backup, a crash mid-write or a bug in another version writes what the next start reads.

So before each example the probe stops the gateway (alternately a clean SIGTERM and a SIGKILL crash,
a few ledger commit intervals after the last answer: what the ledger promises to keep through a
crash is what it committed, bench/chaos/gateway_kill.py) and damages 1-3 of its files, a kind of
file drawn first, then the damage: a garbage line inserted mid-file, bytes that are not UTF-8, JSON
of any other shape or a record's field set to a value of the wrong type (text, NaN, Infinity, 1e308,
-5), a truncated file, a zero-length file, a huge single line (`HUGE_BYTES`), bytes overwritten at a
random offset, the file replaced by a directory, made unreadable (chmod 000: as root, reads are
still allowed, and the draw says so) or removed. Then it starts the gateway again and sends a mix:
chat completions (streamed and not), a key made through the admin API (`GET /v1/key` and a chat
request), keys created and read through the admin API, the usage report, tenants' spend, programs,
the audit log, uploads, batches (made, read, listed, their output downloaded), `/openapi.json` and
the console's page.

Targets:
- the gateway starts after every damage but one: a key store SQLite cannot read (or that fails its
  integrity check) stops the start with one line naming the file and what to do (docs/security.md:
  serving with keys silently missing would lock their users out); the probe then restores the
  operator's backup and starts again;
- no request meets a bug: no 5xx, no closed socket, nothing of `UNEXPECTED_IN_LOG` and no traceback
  in any start's log;
- every generating request recorded exactly once in the ledger, but for the records whose lines the
  probe itself damaged: every record whose line the damage left whole is still read;
- nothing the damage did not touch is lost: every key made through the admin API authenticates
  after each restart unless the key store was the file damaged, and even then not silently (a start
  without them says so in its log: a missing file is a first start, a document that is no key is
  named);
- memory stays bounded: the gateway's peak RSS grows less than `RSS_BOUND_MIB` over its first
  start's, though lines of `HUGE_BYTES` lie in the files it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.common import (
    ADMIN,
    KEY,
    MODEL,
    batch_lines,
    examples_block,
    fuzz_settings,
    policies,
    unexpected_errors,
)
from bench.chaos.fuzz import json_values
from bench.chaos.surfaces import request
from gateway.ledger.reader import bounded_lines, iter_entries
from tests.support.procs import Gateway, SimEngines, start_gateway, start_sim, static_pool

HUGE_BYTES = 48 * 1024 * 1024  # one line with no newline in it: "tens of MB"
COMMIT_INTERVAL_S = 0.02  # the ledger's group commit
RSS_BOUND_MIB = 32.0  # below HUGE_BYTES: a reader holding one such line whole would cross it
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}

KINDS = ("ledger", "audit", "keys", "file_record", "file_bytes", "file_index", "batch_record", "batch_results")
DAMAGES = (
    "garbage_line",
    "not_utf8",
    "wrong_json",
    "wrong_field",
    "truncate",
    "empty",
    "huge_line",
    "overwrite",
    "directory",
    "unreadable",
    "missing",
)
BAD_VALUES: tuple[bytes, ...] = (
    b'"12"',
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e308",
    b"-5",
    b"null",
    b"[]",
    b"{}",
    b'"x"',
    b"true",
    b"1e999",
)
_JSON = st.builds(lambda v: json.dumps(v).encode(), json_values)  # json: integers past 64 bits too
GENERATING = ("chat", "stream", "made")  # requests with a ledger record of their own id
REQUESTS = (
    "chat",
    "stream",
    "made",
    "key",
    "keys_create",
    "keys_read",
    "usage",
    "tenants",
    "programs",
    "audit",
    "batch",
    "openapi",
    "console",
)
ROOT = os.geteuid() == 0


@dataclass(frozen=True)
class Damage:
    """One drawn damage: every choice is drawn whatever the file turns out to hold (hypothesis needs
    the draws not to depend on outside state), and `apply` uses the ones that fit."""

    kind: str
    damage: str
    pick: int  # which file of the kind, by index
    at: float  # where in the file, 0..1
    garbage: bytes
    bad: bytes  # a value of the wrong type for `wrong_field`

    def files(self, site: Site) -> list[Path]:
        return site.files_of(self.kind)

    def apply(self, site: Site) -> tuple[Path | None, str]:
        """Damage one file of the drawn kind; (the file, a line saying what was done), or (None, why
        not) when the gateway keeps no file of that kind yet."""
        found = self.files(site)
        if not found:
            return None, f"{self.kind}: no file yet"
        path = found[self.pick % len(found)]
        if path.is_dir():  # an earlier damage's directory the gateway left where it was: a file again
            shutil.rmtree(path)
            path.write_bytes(b"")
        path.chmod(0o644)
        data = path.read_bytes()
        done = self._apply(path, data)
        return path, f"{self.kind} {path.name}: {done}"

    def _apply(self, path: Path, data: bytes) -> str:
        cut = int(len(data) * self.at)
        boundary = data.rfind(b"\n", 0, cut) + 1  # the start of the line `cut` falls in
        if self.damage == "garbage_line":
            path.write_bytes(data[:boundary] + self.garbage.replace(b"\n", b" ") + b"\n" + data[boundary:])
            return f"garbage line at byte {boundary}: {self.garbage[:40]!r}"
        if self.damage == "not_utf8":
            path.write_bytes(data[:cut] + b"\xff\xfe\xc3(\x80" + data[cut:])
            return f"bytes that are not UTF-8 at byte {cut}"
        if self.damage == "wrong_json":
            if path.suffix == ".json":  # a whole record: JSON of another shape
                path.write_bytes(self.garbage)
                return f"record replaced by {self.garbage[:40]!r}"
            path.write_bytes(data[:boundary] + self.garbage.replace(b"\n", b" ") + b"\n" + data[boundary:])
            return f"JSON line of another shape at byte {boundary}: {self.garbage[:40]!r}"
        if self.damage == "wrong_field":
            return self._wrong_field(path, data, boundary)
        if self.damage == "truncate":
            path.write_bytes(data[:cut])
            return f"truncated to {cut} of {len(data)} bytes"
        if self.damage == "empty":
            path.write_bytes(b"")
            return "emptied"
        if self.damage == "huge_line":
            with path.open("wb") as fh:
                fh.write(data[:boundary])
                chunk = b"x" * (1 << 20)
                for _ in range(HUGE_BYTES >> 20):
                    fh.write(chunk)
                fh.write(b"\n" + data[boundary:])
            return f"a line of {HUGE_BYTES >> 20} MiB at byte {boundary}"
        if self.damage == "overwrite":
            size = max(1, min(64, len(self.garbage) or 16))
            at = min(cut, max(0, len(data) - 1))
            patch = (self.garbage or b"\x00" * 16)[:size]
            path.write_bytes(data[:at] + patch + data[at + len(patch) :])
            return f"{len(patch)} bytes overwritten at byte {at}"
        if self.damage == "directory":
            path.unlink()
            path.mkdir()
            return "replaced by a directory"
        if self.damage == "unreadable":
            path.chmod(0)
            return "chmod 000" + (" (root: reads still allowed)" if ROOT else "")
        path.unlink()
        return "removed"

    def _wrong_field(self, path: Path, data: bytes, boundary: int) -> str:
        """A record's field (a JSON line's, or a whole `.json` record's) set to a value of the wrong type."""
        end = data.find(b"\n", boundary)
        line = data[boundary : end if end >= 0 else len(data)]
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not record:
            path.write_bytes(data[:boundary] + b'{"ts": ' + self.bad + b"}\n" + data[boundary:])
            return f"a record with ts {self.bad!r} at byte {boundary}"
        names = sorted(record)
        name = names[int(self.at * 997) % len(names)]
        text = orjson.dumps({k: v for k, v in record.items() if k != name})
        changed = text[:-1] + (b"," if len(text) > 2 else b"") + orjson.dumps(name) + b":" + self.bad + b"}"
        path.write_bytes(data[:boundary] + changed + data[boundary + len(line) :])
        return f"field {name!r} set to {self.bad!r} at byte {boundary}"


damages = st.builds(
    Damage,
    kind=st.sampled_from(KINDS),
    damage=st.sampled_from(DAMAGES),
    pick=st.integers(0, 2**16),
    at=st.floats(0.0, 1.0),
    garbage=st.one_of(_JSON, st.binary(max_size=64)),
    bad=st.sampled_from(BAD_VALUES),
)


@dataclass
class Site:
    """One gateway, its engines and the files it keeps, stopped and started again around each damage."""

    workdir: Path
    sim: SimEngines | None = None
    gateway: Gateway | None = None
    logs: list[str] = field(default_factory=list)  # every start's log, once it stopped
    made: list[str] = field(default_factory=list)  # secrets of keys made through the admin API (kept)
    files: list[str] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)
    batch_calls: int = 0
    starts: int = 0
    peak_rss_mib: list[float] = field(default_factory=list)

    @property
    def ledger_dir(self) -> Path:
        return self.workdir / "usage"

    @property
    def audit_dir(self) -> Path:
        return self.workdir / "audit"

    @property
    def keys_db(self) -> Path:
        return self.workdir / "keys.sqlite3"

    @property
    def backup(self) -> Path:
        return self.workdir / "keys-backup.sqlite3"

    @property
    def batch_dir(self) -> Path:
        return self.workdir / "batch"

    def files_of(self, kind: str) -> list[Path]:
        """The gateway's files of `kind` now, in name order (the probe's own backups and what an
        earlier damage left aside excluded)."""
        if kind == "ledger":
            found = sorted(self.ledger_dir.glob("*.jsonl")) if self.ledger_dir.is_dir() else []
        elif kind == "audit":
            found = sorted(self.audit_dir.glob("audit.jsonl*")) if self.audit_dir.is_dir() else []
        elif kind == "keys":
            found = [self.keys_db] if self.keys_db.exists() else []
        else:
            folder, pattern = {
                "file_record": ("files", "*.json"),
                "file_bytes": ("files", "*.jsonl"),
                "file_index": ("files", "*.idx"),
                "batch_record": ("batches", "*.json"),
                "batch_results": ("batches", "*.wal"),
            }[kind]
            where = self.batch_dir / folder
            found = sorted(where.glob(pattern)) if where.is_dir() else []
        return [p for p in found if ".corrupt-" not in p.name]

    def start(self) -> None:
        assert self.sim is not None
        self.starts += 1
        self.gateway = start_gateway(
            self.workdir / "gw",
            pools=[static_pool("llama", MODEL, self.sim.urls)],
            policies=policies(
                [{"scope": "key", "tpm": 100_000_000, "rpm": 1_000_000, "max_concurrent": 1000}],
                [{"scope": "tenant", "usd_per_day": 1e6}, {"scope": "key", "usd_per_day": 1e6}],
            ),
            server={"admin_token": ADMIN},
            state={"backend": "memory", "keys_db": str(self.keys_db)},
            ledger={
                "dir": str(self.ledger_dir),
                "commit_interval_ms": int(COMMIT_INTERVAL_S * 1000),
                "audit": {"dir": str(self.audit_dir)},
            },
            batch={"dir": str(self.batch_dir)},
            predictor={"enabled": False},
            ready_timeout_s=30.0,
        )
        if self.gateway.proc.poll() is not None:  # another process's server answered on the port drawn
            self.logs.append(self.gateway.log())
            self.gateway = None
            raise RuntimeError("the gateway exited while another server answered on its port")

    def stop(self, crash: bool = False) -> None:
        gateway, self.gateway = self.gateway, None
        if gateway is None:
            return
        self.peak_rss_mib.append(_peak_rss_mib(gateway.proc.pid))
        if crash:  # the ledger's promise covers records older than one commit interval (gateway_kill)
            time.sleep(COMMIT_INTERVAL_S * 5)
        gateway.stop(signal.SIGKILL if crash else signal.SIGTERM)
        self.logs.append(gateway.log())
        with (self.workdir / "gateway-starts.log").open("a") as fh:  # every start's, for the reader
            fh.write(f"=== start {self.starts} ({'SIGKILL' if crash else 'SIGTERM'})\n{self.logs[-1]}\n")

    def close(self) -> None:
        self.stop()
        if self.sim is not None:
            self.sim.stop()
        _restore_modes(self.workdir)

    def make_key(self, tag: str) -> tuple[int, str]:
        assert self.gateway is not None
        body = orjson.dumps({"tenant": "bench", "limits": {"tpm": 10_000_000}, "metadata": {"description": tag}})
        status, _, raw = request(self.gateway.port, "POST", "/admin/keys", ADMIN_AUTH, body)
        if status != 201:
            return status, raw[:200].decode("utf-8", "replace")
        return status, str(orjson.loads(raw)["secret"])

    def take_backup(self) -> None:
        """The operator's backup of the key store, taken while the gateway is stopped cleanly."""
        shutil.copyfile(self.keys_db, self.backup)

    def restore_backup(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            target = Path(str(self.keys_db) + suffix)
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.chmod(0o644)
                target.unlink()
        shutil.copyfile(self.backup, self.keys_db)


def _peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:  # the process is gone: no figure, not a failure of the probe
        pass
    return 0.0


def _restore_modes(root: Path) -> None:
    """Make every file the probe made unreadable readable again (so its folder can be removed)."""
    for folder, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            path = Path(folder) / name
            try:
                if stat.S_IMODE(path.lstat().st_mode) == 0:
                    path.chmod(0o755 if path.is_dir() else 0o644)
            except OSError:  # removed meanwhile, or not ours to change: the folder's removal says so
                pass


def send(site: Site, kind: str, request_id: str) -> tuple[int, bytes]:
    """One request of `kind` (see `REQUESTS`); (status, body), status 0 when nothing answered."""
    assert site.gateway is not None
    port = site.gateway.port
    headers = {**AUTH, "x-request-id": request_id}
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi " + request_id[-6:]}]}
    body["max_tokens"] = 4
    admin = {"Authorization": f"Bearer {ADMIN}"}
    if kind in ("chat", "stream"):
        body["stream"] = kind == "stream"
        headers["x-tokenway-program"] = "program-" + request_id[-1]
        status, _, raw = request(port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
    elif kind == "made":
        headers["Authorization"] = f"Bearer {site.made[0]}"
        status, _, raw = request(port, "POST", "/v1/chat/completions", headers, orjson.dumps(body))
    elif kind == "key":
        status, _, raw = request(port, "GET", "/v1/key", {"Authorization": f"Bearer {site.made[-1]}"})
    elif kind == "keys_create":  # made, then used: the key store written and read back at once
        status, secret = site.make_key(request_id)
        if status != 201:
            return status, secret.encode()
        status, _, raw = request(port, "GET", "/v1/key", {"Authorization": f"Bearer {secret}"})
        if status == 200:
            site.made.append(secret)
            del site.made[1:-4]  # the first (made before any damage) and the newest few
    elif kind == "keys_read":
        status, _, raw = request(port, "GET", "/admin/keys?spend=1", admin)
        if status == 200:
            status, _, raw = request(port, "GET", "/admin/keys/made", admin)
            status = 200 if status in (200, 404) else status
    elif kind == "usage":
        status, _, raw = request(port, "GET", "/admin/usage?since=7d&by=tenant,model", admin)
    elif kind == "tenants":
        status, _, raw = request(port, "GET", "/admin/tenants?spend=1", admin)
    elif kind == "programs":
        status, _, raw = request(port, "GET", "/admin/programs", admin)
    elif kind == "audit":
        status, _, raw = request(port, "GET", "/admin/audit?limit=50", admin)
    elif kind == "batch":
        status, raw = batch_call(site, request_id)
    elif kind == "openapi":
        status, _, raw = request(port, "GET", "/openapi.json", {})
    else:
        status, _, raw = request(port, "GET", "/ui", admin)
    return status, raw


def batch_call(site: Site, request_id: str) -> tuple[int, bytes]:
    """One Files or Batch API call, in turn: a file uploaded and a batch made of it, the newest batch
    read, the batches listed, the newest finished batch's output downloaded (else the newest file's
    content)."""
    assert site.gateway is not None
    site.batch_calls += 1
    step = site.batch_calls % 4
    with openai.OpenAI(base_url=site.gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        try:
            if step == 0 or not site.batches:
                lines = batch_lines(request_id)
                file = client.files.create(file=("in.jsonl", lines), purpose="batch")
                site.files = [*site.files[-7:], file.id]
                batch = client.batches.create(
                    input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                site.batches = [*site.batches[-7:], batch.id]
                return 200, batch.id.encode()
            if step == 1:
                return 200, client.batches.retrieve(site.batches[-1]).model_dump_json().encode()
            if step == 2:
                return 200, orjson.dumps([b.id for b in client.batches.list(limit=20)])
            for batch_id in reversed(site.batches):
                found = client.batches.retrieve(batch_id)
                if found.output_file_id:
                    return 200, client.files.content(found.output_file_id).content[:200]
            return 200, client.files.content(site.files[-1]).content[:200]
        except openai.NotFoundError as exc:  # a record the damage took: gone, said so
            return 404, exc.response.content
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.content
        except openai.APIConnectionError as exc:
            return 0, f"{step}: {exc!r} {exc.__cause__!r}".encode()


def ledger_lines(path: Path) -> dict[bytes, str]:
    """The whole lines of a ledger file that are records, with their request ids (what a damage of
    the file may take away)."""
    if not path.is_file():
        return {}
    out: dict[bytes, str] = {}
    try:
        with path.open("rb") as fh:
            for line in fh:
                if len(line) < 65536 and line.endswith(b"\n"):
                    try:
                        record = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(record, dict) and isinstance(record.get("request_id"), str):
                        out[line] = record["request_id"]
    except OSError:
        return {}
    return out


def surviving_lines(path: Path) -> set[bytes]:
    if not path.is_file():
        return set()
    try:
        with path.open("rb") as fh:
            return {line for line in fh if len(line) < 65536}
    except OSError:
        return set()


def run(workdir: Path, *, examples: int = 300, seed: int | None = None) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    site = Site(workdir)
    site.sim = start_sim(workdir, count=1, served_model_name=MODEL, time_scale=100.0)
    try:
        return fuzz(site, examples=examples, seed=seed)
    finally:
        site.close()  # the gateway and the engine: nothing the probe started outlives it


def fuzz(site: Site, *, examples: int, seed: int | None) -> dict[str, Any]:
    site.start()
    status, secret = site.make_key("made before any damage")
    if status != 201:
        raise RuntimeError(f"POST /admin/keys: {status} {secret}")
    site.made = [secret]
    for n in range(2):  # every kind of request: the files they write exist before the first damage
        for kind in REQUESTS:
            send(site, kind, f"disk-warm-{n}-{uuid.uuid4().hex[:8]}")
    time.sleep(1.0)  # the warm-up batches run to their end
    site.stop()
    site.take_backup()
    sent: list[str] = []
    statuses: dict[int, int] = {}
    samples: dict[str, str] = {}
    failures: list[str] = []
    actions: list[str] = []
    damaged_kinds: dict[str, int] = {}
    refused: list[str] = []  # starts refused by design (the key store), with the line that said so
    destroyed: set[str] = set()  # request ids whose ledger line a damage touched
    keys_lost = 0  # made keys refused after a restart that damaged the key store (allowed)
    key_outcomes: dict[str, dict[str, int]] = {}  # what each damage of the key store led to

    def outcome(damage: str, what: str) -> None:
        found = key_outcomes.setdefault(damage, {})
        found[what] = found.get(what, 0) + 1

    starts_s: list[float] = []
    drawn = [0]
    started_s = time.monotonic()

    @fuzz_settings(examples, seed)
    @given(st.data())
    def probe(data: st.DataObject) -> None:
        try:
            example(data)
        except Exception as exc:  # the probe's own trouble (a start that failed twice): reported, never
            # raised to hypothesis, whose replay of a failing example would meet other files
            failures.append(f"the example failed: {type(exc).__name__}: {str(exc)[-600:]}")
            recover(site)

    def example(data: st.DataObject) -> None:
        nonlocal keys_lost
        drawn[0] += 1
        if site.gateway is not None:
            site.stop(crash=drawn[0] % 2 == 0)  # alternately a clean stop and a crash
        drawn_damages = data.draw(st.lists(damages, min_size=1, max_size=3))
        kinds_sent = data.draw(st.lists(st.sampled_from(REQUESTS), min_size=2, max_size=6))  # all drawn first:
        # an example that fails midway must not draw less than its replay (hypothesis's consistency check)
        done: list[str] = []
        kinds: set[str] = set()
        refusals = len(refused)

        def refused_now() -> bool:
            return len(refused) > refusals

        def key_damages() -> str:
            return "+".join(sorted({d.damage for d in drawn_damages if d.kind == "keys"}))

        for damage in drawn_damages:
            before = {}
            if damage.kind == "ledger":
                before = {p: ledger_lines(p) for p in site.files_of("ledger")}
            path, line = damage.apply(site)
            done.append(line)
            if path is None:
                continue
            kinds.add(damage.kind)
            damaged_kinds[damage.kind] = damaged_kinds.get(damage.kind, 0) + 1
            if damage.kind == "ledger":
                kept = surviving_lines(path)
                destroyed.update(rid for text, rid in before.get(path, {}).items() if text not in kept)
        actions.extend(done)
        began = time.monotonic()
        try:
            site.start()
        except RuntimeError as exc:
            log = str(exc)
            site.logs.append(log)
            if "keys" in kinds and "key store" in log and "Traceback" not in log:
                said = next((ln for ln in log.splitlines() if "key store" in ln), "")
                refused.append(said.replace(str(site.workdir), "<dir>"))
                outcome(key_damages(), "refused to start")
                site.restore_backup()  # the operator's answer: the backup put back
                site.start()
            else:
                failures.append(f"did not start after {done}: {log[-600:]}")
                site.restore_backup()
                _repair(site)
                site.start()
        starts_s.append(time.monotonic() - began)
        assert site.gateway is not None
        lost_now = 0
        for secret in list(site.made):  # keys made through the admin API, still known after the restart
            status, _, raw = request(site.gateway.port, "GET", "/v1/key", {"Authorization": f"Bearer {secret}"})
            if status == 401 and "keys" in kinds:
                lost_now += 1
                site.made.remove(secret)
            elif status != 200:
                failures.append(f"a made key answered {status} {raw[:120]!r} after {done}")
        keys_lost += lost_now
        if "keys" in kinds and not refused_now():
            logged = "key store" in site.gateway.log()  # "not found: starting an empty one", "unreadable key"
            if lost_now and not logged:
                failures.append(f"made keys lost without a word in the log after {done}")
            outcome(
                key_damages(),
                ("started, keys lost, said in the log" if logged else "started, keys lost silently")
                if lost_now
                else "started, keys kept",
            )
        if not site.made:  # the key store lost them all: the backup is what the operator has
            site.stop()
            site.restore_backup()
            site.start()
            site.made = [_first_secret(site)]
        for kind in kinds_sent:
            request_id = f"disk-fuzz-{kind}-{uuid.uuid4().hex[:12]}"
            status, raw = send(site, kind, request_id)
            if kind in GENERATING:
                sent.append(request_id)
            statuses[status] = statuses.get(status, 0) + 1
            samples.setdefault(f"{kind} {status}", raw[:200].decode("utf-8", "replace"))
            if status == 0 or status >= 500:
                failures.append(f"{kind}: {status} {raw[:200]!r} after {done}")
        _tidy(site)
        if "keys" in kinds:  # the next example starts from the operator's backup again
            site.stop()
            site.restore_backup()
            site.start()
            site.made = [_first_secret(site)]

    probe()
    seconds = time.monotonic() - started_s
    site.stop()
    site.start()  # one more start: the records of the last example's requests are read back
    counts: dict[str, int] = {}
    for record in iter_entries(site.ledger_dir, warn=lambda _: None) if site.ledger_dir.is_dir() else []:
        request_id = str(record.get("request_id", ""))
        if request_id.startswith("disk-fuzz-"):
            counts[request_id] = counts.get(request_id, 0) + 1
    site.stop()
    unrecorded = [r for r in sent if r not in counts and r not in destroyed]
    logs = "\n".join(site.logs)
    peaks = [p for p in site.peak_rss_mib if p > 0]
    return {
        "examples": examples,
        "seed": seed,
        "requests": sum(statuses.values()),
        "damages": len(actions),
        "damaged_kinds": dict(sorted(damaged_kinds.items())),
        "statuses": dict(sorted(statuses.items())),
        "samples": samples,
        "failures": len(failures),
        "failure_examples": failures[:5] + _tracebacks(logs)[:3],
        "refused_starts": len(refused),
        "refusal_example": refused[0] if refused else "",
        "starts": site.starts,
        "start_s_median": round(sorted(starts_s)[len(starts_s) // 2], 2) if starts_s else 0.0,
        "unrecorded": len(unrecorded),
        "unrecorded_examples": unrecorded[:5],
        "destroyed": sum(1 for r in sent if r in destroyed),
        "recorded_twice": sum(1 for c in counts.values() if c > 1),
        "keys_lost_with_store": keys_lost,
        "key_store_outcomes": {k: dict(sorted(v.items())) for k, v in sorted(key_outcomes.items())},
        "unexpected_in_log": unexpected_errors(logs),
        "tracebacks_in_log": logs.count("Traceback"),
        "rss_first_mib": round(peaks[0], 1) if peaks else 0.0,
        "rss_peak_mib": round(max(peaks), 1) if peaks else 0.0,
        "seconds": round(seconds, 1),
        "root": ROOT,
    }


def _tracebacks(logs: str) -> list[str]:
    """The last lines of each traceback in the logs (what raised, and where)."""
    found = []
    for part in logs.split("Traceback (most recent call last):")[1:]:
        lines = [ln for ln in part.splitlines() if ln.strip()]
        end = next((i for i, ln in enumerate(lines) if not ln.startswith(" ")), len(lines) - 1)
        found.append("traceback: " + " | ".join(ln.strip() for ln in lines[max(0, end - 2) : end + 1]))
    return found


def _first_secret(site: Site) -> str:
    """A key made through the admin API after the backup was put back (the backup's own made key's
    secret is the probe's first; it is kept in `made` only while it authenticates)."""
    status, secret = site.make_key("made again after a restore")
    if status != 201:
        raise RuntimeError(f"POST /admin/keys after a restore: {status} {secret}")
    return secret


def recover(site: Site, tries: int = 3) -> None:
    """The operator's repair after an example the probe could not finish: everything the damage left
    set aside, the key store's backup put back, the gateway started again."""
    for attempt in range(tries):
        try:
            site.stop()
            _repair(site)
            site.restore_backup()
            site.start()
            site.made = [_first_secret(site)]
            return
        except Exception:
            if attempt == tries - 1:
                raise


def _tidy(site: Site) -> None:
    """After an example, what an operator would clear away, so that damage does not pile up over
    hundreds of examples: what the gateway set aside (`*.corrupt-<n>`, kept for the operator) is
    deleted, and lines past any record's length are cut out of the ledger and audit files (the
    records around them stay, byte for byte)."""
    for path in site.workdir.rglob("*.corrupt-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for path in [*site.files_of("ledger"), *site.files_of("audit")]:
        if path.is_file() and path.stat().st_size > HUGE_BYTES // 2:
            with path.open("rb") as fh:
                kept = [line for line in bounded_lines(fh) if isinstance(line, bytes)]
            path.write_bytes(b"".join(kept))


def _repair(site: Site) -> None:
    """What an operator does when the gateway will not start: every damaged file set aside."""
    _restore_modes(site.workdir)
    for kind in KINDS:
        for path in site.files_of(kind):
            if path.is_dir() and kind != "keys":
                shutil.rmtree(path)


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["unexpected_in_log"] == 0
        and r["tracebacks_in_log"] == 0
        and r["unrecorded"] == 0
        and r["recorded_twice"] == 0
        and r["rss_peak_mib"] - r["rss_first_mib"] < RSS_BOUND_MIB
    )


def section(r: dict[str, Any]) -> list[str]:
    statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
    kinds = ", ".join(f"{k}: {v}" for k, v in r["damaged_kinds"].items())
    said = r["refusal_example"].partition(";")[0]
    refusal = f" (`{said}; …`)" if said else ""
    lines = [
        "## Files on disk that hold anything (hypothesis)",
        "",
        f"{r['examples']} examples{schema_fuzz.seeded(r)} in {r['seconds']:g} s: one gateway (`state: memory`) "
        "stopped before each example, alternately with SIGTERM and SIGKILL, 1-3 of its files damaged, a kind of "
        "file drawn first (the usage ledger, the audit log, the key store, the batch store's file records, bytes, "
        "line indexes, batch records and result logs), then the damage (a garbage line, bytes that are not UTF-8, "
        "JSON of another shape, a field of the wrong type, truncated, emptied, a line of "
        f"{HUGE_BYTES >> 20} MiB, bytes overwritten, a directory, chmod 000"
        + (" (the run was root's: reads still allowed)" if r["root"] else "")
        + f", removed), and started again: {r['damages']} damages ({kinds}), {r['starts']} starts (median "
        f"{r['start_s_median']:g} s). {r['requests']} requests (chat streamed or not, a key made through the "
        "admin API, keys created and read, the usage report, tenants' spend, programs, the audit log, uploads "
        "and batches made, read, listed and downloaded, `/openapi.json`, the console). "
        f"Answers by status: {statuses}.",
        "",
        "| met a bug (5xx, no answer, no start) | unexpected errors or tracebacks in the logs | not recorded | "
        "recorded twice | records the damage took | starts refused (the key store) | made keys lost with the "
        "key store | peak RSS, first start → any (MiB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {r['failures']} | {r['unexpected_in_log'] + r['tracebacks_in_log']} | {r['unrecorded']} | "
        f"{r['recorded_twice']} | {r['destroyed']} | {r['refused_starts']}{refusal} | {r['keys_lost_with_store']} | "
        f"{r['rss_first_mib']:g} → {r['rss_peak_mib']:g} |",
        "",
        "What each damage of the key store led to: "
        + (
            "; ".join(
                f"{damage}: " + ", ".join(f"{what} {n}" for what, n in found.items())
                for damage, found in r["key_store_outcomes"].items()
            )
            or "(none drawn)"
        )
        + ".",
        "",
        "Targets (every start succeeds, but a key store SQLite cannot read, which stops it with one line naming "
        "the file and what to do; no request meets a bug and no start logs one; every chat request recorded "
        "exactly once but for those whose ledger line the damage itself took; every key made through the admin "
        "API still authenticates unless the key store was damaged; peak RSS within "
        f"{RSS_BOUND_MIB:g} MiB of the first start's with {HUGE_BYTES >> 20} MiB lines in the files it reads): "
        f"{'met' if met(r) else '**missed**'}.",
        "",
    ]
    unrecorded = [f"not recorded: {r}" for r in r["unrecorded_examples"]]
    return lines + examples_block(r["failure_examples"] + unrecorded)
