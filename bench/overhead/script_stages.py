"""Where redis-server's CPU goes in one reservation of `bench.overhead.hierarchy`'s policies: the
reservation replayed on a raw, pipelined connection (no client in the way), with `reserve.lua` cut
short after each stage, so the difference between two rows is what that stage costs Redis.

    .venv/bin/python -m bench.overhead.script_stages [--requests 20000] [--rounds 3]

Prints a markdown table (µs of redis-server CPU per reservation, median of the rounds, for the three
buckets and for the hierarchy; the last row is a reservation and its settlement together); the reading of a run lives in
bench/results/overhead-hierarchy.notes.md. The stages are cut where `reserve.lua`'s own lines say
(`STAGES`): an edit of the script that moves them makes this fail loudly, not measure something else.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import hiredis

from bench.limiter.common import RedisServer
from bench.overhead.hierarchy import policy
from bench.overhead.run import cpu_seconds
from policies.limits import memory_store
from policies.limits.redis_store import RedisStore
from policies.limits.scriptpipe import Arg, EvalSha, Pre, Script, command, load_script
from policies.types import RequestSubjects

# (label, the line of reserve.lua the stage stops before; None: the whole script)
STAGES: list[tuple[str, str | None]] = [
    ("the EVALSHA itself (its keys and arguments), empty body", ""),
    ("+ clock and plan parsed", "local ok = 1"),
    ("+ buckets read, leases counted, ticket checked", "-- per budget: spend"),
    ("+ budgets read (HMGET, period compared)", "if ok == 1 then"),
    ("+ everything written", "if ok == 'again' then"),
    ("+ reply built (the whole script)", None),
]
SETTLED = "the whole reservation and its settlement (settle.lua)"


def stage_source(cut: str | None) -> str:
    """reserve.lua behind the shared preamble, stopped before the line `cut` ('' = at once)."""
    files = resources.files("policies.limits")
    preamble = files.joinpath("preamble.lua").read_text(encoding="utf-8")
    body = files.joinpath("reserve.lua").read_text(encoding="utf-8")
    if cut is None:
        return preamble + body
    if cut == "":
        return preamble + "return 1\n"
    at = body.find("\n" + cut)
    if at < 0:
        raise SystemExit(f"reserve.lua has no line {cut!r}: update STAGES")
    return preamble + body[: at + 1] + "return 1\n"


def reservations(hierarchy: bool, store: RedisStore, script: Script, n: int, salt: int, settle: bool = False) -> bytes:
    """`n` reservations of the bench's request under fresh ticket ids, as one RESP byte string;
    `settle`: each followed by its settlement (10 of the 16 output tokens reserved were used)."""
    p = policy(hierarchy)
    principal = p.authenticate("sk-bench-hierarchy")
    assert principal is not None
    subjects = RequestSubjects(tags=("feature-x",)) if hierarchy else RequestSubjects()
    plan = p.admission_plan(principal, "m", subjects)
    enc = store._encoded(plan)
    evalsha = EvalSha(script, enc.reserve.keys, enc.reserve.nargs)
    costs = " ".join(repr(c) for c in [1.0] + [46.0] * (len(plan.buckets) - 1))
    fixed: list[Arg] = [enc.lease_ttl, enc.ticket_ttl]
    deltas = " ".join(repr(c) for c in [0.0] + [-6.0] * (len(plan.buckets) - 1))
    now = time.time()
    periods = " ".join(str(memory_store.period_id(budget.period, now)) for budget in plan.budgets)
    out = []
    for i in range(n):
        ticket = f"s{salt}-{i}"
        args: list[Arg] = [Pre(""), ticket, *fixed, repr(6.2e-06), enc.reserve_plan, costs, *enc.run_args]
        out.append(evalsha.encode(args))
        if settle:
            out.append(
                enc.settle.encode(
                    [Pre(""), ticket, Pre("z"), Pre("86400"), repr(-1.2e-06), enc.settle_plan, deltas, periods]
                )
            )
    return b"".join(out)


def replay(port: int, data: bytes, n: int) -> None:
    """Send `data` (n commands) and read n replies; any error reply stops the bench."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(data)
        reader = hiredis.Reader()
        got = 0
        while got < n:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise SystemExit("redis closed the connection")
            reader.feed(chunk)
            while (reply := reader.gets()) is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise SystemExit(f"script error: {reply}")
                got += 1


def flush(port: int) -> None:
    """Every key gone (tickets of the previous replay included), the scripts kept: each replay starts
    from the same empty state."""
    replay(port, command(b"FLUSHALL"), 1)


def measure(requests: int, rounds: int) -> dict[tuple[str, bool], list[float]]:
    found: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            store = RedisStore.from_url(server.url)
            scripts = {label: Script(stage_source(cut)) for label, cut in STAGES}
            with socket.create_connection(("127.0.0.1", server.port)) as conn:  # load every stage's script
                sources = [s.source for s in scripts.values()] + [load_script("policies.limits", "settle.lua").source]
                conn.sendall(b"".join(command(b"SCRIPT", b"LOAD", source.encode()) for source in sources))
                reader, loaded = hiredis.Reader(), 0
                while loaded < len(sources):
                    reader.feed(conn.recv(1 << 16))
                    while reader.gets() is not False:
                        loaded += 1
            salt = 0
            for _ in range(rounds):
                for hierarchy in (False, True):
                    for label, _cut in STAGES:
                        salt += 1
                        data = reservations(hierarchy, store, scripts[label], requests, salt)
                        flush(server.port)
                        before = cpu_seconds(server.proc.pid)
                        replay(server.port, data, requests)
                        spent = cpu_seconds(server.proc.pid) - before
                        found.setdefault((label, hierarchy), []).append(spent / requests * 1e6)
                    salt += 1
                    data = reservations(hierarchy, store, scripts[STAGES[-1][0]], requests, salt, settle=True)
                    flush(server.port)
                    before = cpu_seconds(server.proc.pid)
                    replay(server.port, data, 2 * requests)
                    spent = cpu_seconds(server.proc.pid) - before
                    found.setdefault((SETTLED, hierarchy), []).append(spent / requests * 1e6)
        finally:
            server.stop()
    return found


def table(found: dict[tuple[str, bool], list[float]]) -> str:
    lines = [
        "| after | three buckets | hierarchy |",
        "| --- | ---: | ---: |",
    ]
    for label in [*(label for label, _cut in STAGES), SETTLED]:
        three, hier = (statistics.median(found[(label, h)]) for h in (False, True))
        lines.append(f"| {label} | {three:.1f} | {hier:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(table(measure(args.requests, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
