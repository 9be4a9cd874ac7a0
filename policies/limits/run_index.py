"""The index of live agent runs (policies/limits/runs.py): the runs whose calls were admitted last,
when, and by which key and model. The memory store keeps it here; reserve.lua keeps the same in Redis.
It only names runs: what each used stays in the run's own counters."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from policies.limits import buckets
from policies.limits.types import RunRef

INDEX_MAX = 10_000  # runs kept in the index, the least recently seen forgotten first
TRIM_SLACK = 64  # Redis trims the index once it is this far over its bound, in one batch
READ_MAX = 1_000  # newest index entries one listing reads (before its tenant filter)


@dataclass(frozen=True, slots=True)
class RunSeen:
    """One index entry: a run, when its last admitted call was, and the key and model that made it."""

    tenant: str
    program: str
    last_seen_s: float
    key_id: str
    model: str


def parse_entry(subject: str, last_seen_s: float, meta: str) -> RunSeen | None:
    """An entry as the Redis index stores it (`tenant/program`, and `key model`); None if malformed."""
    tenant, sep, program = subject.partition("/")
    key_id, _, model = meta.partition(" ")
    if not sep or not tenant or not program or not key_id:
        return None
    return RunSeen(tenant, program, last_seen_s, key_id, model)


class RunIndex:
    """The memory store's index: run subject -> (last seen, key, model), least recently seen first."""

    def __init__(self, max_runs: int = INDEX_MAX) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[str, tuple[float, RunRef, str]] = OrderedDict()

    def touch(self, run: RunRef, model: str, now_s: float) -> None:
        subject = run.subject
        self._runs[subject] = (now_s, run, model)
        self._runs.move_to_end(subject)
        while len(self._runs) > self.max_runs:
            self._runs.popitem(last=False)

    def recent(self, limit: int, now_s: float) -> list[RunSeen]:
        """The `limit` runs seen last, newest first, none idle past the counters' expiry."""
        out: list[RunSeen] = []
        for seen_s, run, model in reversed(self._runs.values()):
            if len(out) >= limit:
                break
            if now_s - seen_s <= buckets.IDLE_TTL_S:
                out.append(RunSeen(run.tenant, run.program, seen_s, run.key_id, model))
        return out

    def clear(self) -> None:
        self._runs.clear()

    def __len__(self) -> int:
        return len(self._runs)
