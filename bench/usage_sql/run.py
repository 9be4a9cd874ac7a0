"""SQL-spend benchmark: `tokenway usage sql` over a synthetic ledger, beside `tokenway usage report`
on the same rows: seconds and peak RSS of the first query (which loads every line into the SQLite
store), of the same query again (nothing new to load), and of a query that the time index narrows.

The ledger is bench/usage_report's (same generator, same seed: 24 tenant x model groups, one finish
time per 1 ms). Each command runs as its own process; its peak RSS is the child's ru_maxrss. The
GROUP BY's totals are checked against the report's (requests and cost per group), so a fast wrong
answer cannot pass.

    .venv/bin/python -m bench.usage_sql                 # 1M rows (~740 MiB of ledger, ~0.6 GiB of store)
    .venv/bin/python -m bench.usage_sql --rows 100000 1000000
Results: bench/results/usage-sql.md (and .json).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.usage_report.run import write_ledger

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
GROUP_BY = (
    "SELECT tenant, model, count(*) AS requests, sum(input_tokens) AS input_tokens,"
    " sum(output_tokens) AS output_tokens, sum(cost_usd) AS cost_usd FROM usage GROUP BY 1, 2"
)
CPU_S: list[float] = []  # CPU seconds (user + system) of each measured process, in order
# the ledger's last minute (about 60,000 rows: one start per ms), which the ts index narrows
RECENT = (
    "SELECT tenant, count(*) AS requests, sum(cost_usd) AS cost_usd FROM usage"
    " WHERE ts >= (SELECT max(ts) FROM usage) - 60 GROUP BY 1"
)


def measure(argv: list[str]) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, stdout) of one child process (its own rusage, from wait4); its CPU
    seconds (user + system) go to CPU_S, since other work on the machine stretches wall time."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[:6]} failed:\n{stderr.decode(errors='replace')[-2000:]}")
        out.seek(0)
        CPU_S.append(usage.ru_utime + usage.ru_stime)
        return wall, usage.ru_maxrss / 1024.0, out.read().decode()


def check_totals(report_csv: str, sql_csv: str) -> None:
    """The SQL GROUP BY and the report agree on every group's requests and cost."""
    report = {(r["tenant"], r["model"]): r for r in csv.DictReader(io.StringIO(report_csv)) if r["tenant"] != "TOTAL"}
    sql = {(r["tenant"], r["model"]): r for r in csv.DictReader(io.StringIO(sql_csv))}
    assert report.keys() == sql.keys(), (sorted(report), sorted(sql))
    for key, row in report.items():
        assert int(row["requests"]) == int(sql[key]["requests"]), key
        assert abs(float(row["cost_usd"]) - float(sql[key]["cost_usd"])) < 1e-5, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--dir", default=None, help="where the synthetic ledgers go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic ledgers and stores")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tokenway-usage-sql-bench-"))
    cli = [sys.executable, "-m", "gateway.app.cli", "usage"]
    results = []
    empty = base / "empty"
    empty.mkdir(parents=True, exist_ok=True)
    _, baseline_rss, _ = measure([*cli, "sql", "SELECT 1", "--dir", str(empty)])
    print(f"empty ledger: usage sql peaks at {baseline_rss:.0f} MiB (the interpreter and imports)", flush=True)
    try:
        for rows in sorted(args.rows):
            directory = base / f"rows-{rows}"
            size = write_ledger(directory, rows)
            (directory / "usage.sqlite").unlink(missing_ok=True)
            for suffix in ("-wal", "-shm"):
                (directory / f"usage.sqlite{suffix}").unlink(missing_ok=True)
            print(f"{rows:,} rows: {size / 2**20:,.0f} MiB of ledger", flush=True)
            row: dict[str, float] = {"rows": rows, "ledger_mib": size / 2**20, "baseline_rss_mib": baseline_rss}
            report = [*cli, "report", "--dir", str(directory), "--since", "400d", "--by", "tenant,model"]
            wall, rss, report_out = measure([*report, "--format", "csv", "--progress", "off"])
            row.update(report_s=wall, report_cpu_s=CPU_S[-1], report_rss_mib=rss)
            print(
                f"  usage report:            {wall:6.1f} s ({CPU_S[-1]:.1f} s CPU), peak RSS {rss:4.0f} MiB", flush=True
            )
            sql = [*cli, "sql", GROUP_BY, "--dir", str(directory), "--format", "csv"]
            wall, rss, sql_out = measure(sql)
            check_totals(report_out, sql_out)
            row.update(ingest_s=wall, ingest_cpu_s=CPU_S[-1], ingest_rss_mib=rss)
            print(
                f"  usage sql, first (load): {wall:6.1f} s ({CPU_S[-1]:.1f} s CPU), peak RSS {rss:4.0f} MiB", flush=True
            )
            wall, rss, again = measure(sql)
            assert again == sql_out
            row.update(query_s=wall, query_cpu_s=CPU_S[-1], query_rss_mib=rss)
            print(
                f"  usage sql, again:        {wall:6.1f} s ({CPU_S[-1]:.1f} s CPU), peak RSS {rss:4.0f} MiB", flush=True
            )
            wall, rss, recent = measure([*cli, "sql", RECENT, "--dir", str(directory), "--format", "csv"])
            assert sum(int(r["requests"]) for r in csv.DictReader(io.StringIO(recent))) > 0
            row.update(recent_s=wall, recent_cpu_s=CPU_S[-1], recent_rss_mib=rss)
            print(
                f"  usage sql, last minute:  {wall:6.1f} s ({CPU_S[-1]:.1f} s CPU), peak RSS {rss:4.0f} MiB", flush=True
            )
            row["store_mib"] = (directory / "usage.sqlite").stat().st_size / 2**20
            row["load_avg"] = os.getloadavg()[0]
            print(f"  store: {row['store_mib']:,.0f} MiB", flush=True)
            results.append(row)
            if not args.keep:
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    write_results(results)
    return 0


def write_results(results: list[dict[str, float]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "usage-sql.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# SQL spend: `tokenway usage sql` against `tokenway usage report`",
        "",
        "`python -m bench.usage_sql`: the ledger of bench/usage_report (same generator and seed), then, each its",
        "own process (peak RSS: its `ru_maxrss`): `usage report --by tenant,model --format csv`; `usage sql`",
        "with a GROUP BY tenant, model of requests, tokens and cost, first over an empty store (every line",
        "is loaded into `usage.sqlite`, then queried), then again (nothing new: the query alone); then a query",
        "of the ledger's last minute, which the `ts` index narrows. The GROUP BY's totals are checked against the",
        "report's for every group. Over an empty ledger `usage sql` peaks at "
        f"{results[0]['baseline_rss_mib']:,.0f} MiB (the interpreter and the CLI's imports);",
        "loading adds SQLite's page cache (capped at 64 MiB) and one batch of 20,000 rows.",
        "",
        "Times are wall seconds with the process's CPU seconds (user + system) beside them: the 2-core VM",
        "was shared with other work during the run "
        f"(load average {max(r['load_avg'] for r in results):.1f} at the end).",
        "",
        "| rows | ledger | report | peak RSS | sql: load + query | peak RSS | sql: query | peak RSS "
        "| sql: last minute | peak RSS | store |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines.extend(
        f"| {r['rows']:,.0f} | {r['ledger_mib']:,.0f} MiB | {r['report_s']:.1f} s ({r['report_cpu_s']:.1f}) "
        f"| {r['report_rss_mib']:,.0f} MiB | {r['ingest_s']:.1f} s ({r['ingest_cpu_s']:.1f}) "
        f"| {r['ingest_rss_mib']:,.0f} MiB | {r['query_s']:.1f} s ({r['query_cpu_s']:.1f}) "
        f"| {r['query_rss_mib']:,.0f} MiB | {r['recent_s']:.1f} s ({r['recent_cpu_s']:.1f}) "
        f"| {r['recent_rss_mib']:,.0f} MiB | {r['store_mib']:,.0f} MiB |"
        for r in results
    )
    big = max(results, key=lambda r: r["rows"])
    scale = 10_000_000 / big["rows"]
    lines += [
        "",
        f"**10 million rows: an extrapolation from {big['rows']:,.0f}, not a measurement.** Loading is linear in",
        "rows (each batch appends to the table; the `ts` index grows at its end and the tenant, key and model",
        "indexes at a few hundred insertion points that stay in the page cache), so the first `usage sql`",
        f"over 10 million rows would take about {big['ingest_cpu_s'] * scale / 60:,.0f} CPU minutes and "
        f"leave a store of about {big['store_mib'] * scale / 1024:,.1f} GiB;",
        "later runs load only what is new. Its memory does not grow with rows: one batch of 20,000 rows and",
        f"SQLite's page cache (64 MiB) over the interpreter, {big['ingest_rss_mib']:,.0f} MiB here. A GROUP BY",
        f"over the whole table reads it once: about {(big['query_cpu_s'] - 1.3) * scale:,.0f} CPU seconds at 10",
        "million (the query's own time, less the ~1.3 s the command takes to start), in the query",
        "connection's 16 MiB page cache, sorting and grouping in temporary files past it; a query that",
        "filters on `ts`, `tenant`, `key_id` or `model` reads only its index range. The report reads every",
        "line of the window on every run instead: it is the faster first answer, SQL the faster tenth.",
        "",
    ]
    (RESULTS / "usage-sql.md").write_text("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
