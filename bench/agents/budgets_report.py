"""The run-budget part's numbers, markdown and plot, from every round's runs (budgets.py).

A run's spend is read three ways: the gateways' counter (`GET /v1/key?program=`, the tight cap's row),
the ledger's records of the run (both replicas' files), and what the client was told (the 200s'
`x-tokenway-cost-usd` and `usage`). Overshoot is the largest of the three less the cap, in the cap's
own unit; the target of issue 44 is 0 for every run. The three must also agree with each other (the
ledger's exactness promise): the largest gap is reported, as is the ledger's total against the sum
of the counters. What a run leaves unspent under its cap (a call refused because its reservation,
priced at its `max_tokens`, no longer fits) is the price of never overshooting, so it is shown too.
A person's reading goes in bench/results/agents-run-budgets.notes.md (`bench/notes.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import notes

ORDER = ("usd", "tokens", "calls")
UNIT = {"usd_per_run": "$", "tokens_per_run": "tokens", "calls_per_run": "calls"}
LEDGER_FIELD = {"usd_per_run": "usd", "tokens_per_run": "tokens", "calls_per_run": "calls"}
EPS = {"usd_per_run": 1e-6, "tokens_per_run": 0.5, "calls_per_run": 0.5}  # the counters' rounding


def runs(raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [r for rows in raw["rounds"].values() for r in rows]


def client_value(run: Mapping[str, Any], dimension: str) -> float:
    if dimension == "usd_per_run":
        return float(run["client_usd"])
    if dimension == "tokens_per_run":
        return float(run["client_tokens"])
    return float(run["served"])


def spends(run: Mapping[str, Any], dimension: str) -> tuple[float, float, float]:
    """(counter, ledger, client) of one run in `dimension`; the counter from the tight cap's row when
    the run has one, else the loose rule's."""
    counter = run["counter"].get(dimension, run["loose"].get(dimension, float("nan")))
    return float(counter), float(run["ledger"][LEDGER_FIELD[dimension]]), client_value(run, dimension)


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Tenant (the cap that binds) -> its runs' counts, overshoot, agreement and unspent headroom."""
    out: dict[str, dict[str, Any]] = {}
    everything = runs(raw)
    for tenant in [t for t in ORDER if t in raw["caps"]]:
        dimension, cap = raw["caps"][tenant]
        mine = [r for r in everything if r["tenant"] == tenant]
        triples = [spends(r, dimension) for r in mine]
        highest = [max(t) for t in triples]
        over = [h - cap for h in highest]
        gaps = []
        for r in mine:  # every dimension the run's counters keep, counter against ledger and client
            for dim in LEDGER_FIELD:
                if dim in r["counter"] or dim in r["loose"]:
                    c, led, cl = spends(r, dim)
                    gaps.append((dim, abs(c - led), abs(led - cl)))
        out[tenant] = {
            "dimension": dimension,
            "cap": cap,
            "runs": len(mine),
            "sent": sum(r["sent"] for r in mine),
            "served": sum(r["served"] for r in mine),
            "refused": sum(r["refused"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
            "runs_capped": sum(1 for r in mine if r["refused"] > 0),
            "refused_turns": sum(r["refused_turns"] for r in mine),
            "first_refused_turn_p50": pct([r["first_refused_turn"] for r in mine if r["first_refused_turn"] >= 0], 50),
            "served_after_refusal": sum(r["served_after_refusal"] for r in mine),
            "spent_share_p50": pct([h / cap for h in highest], 50),
            "spent_share_max": max((h / cap for h in highest), default=None),
            "overshoot_max": max(over, default=None),
            "runs_over": sum(1 for o in over if o > EPS[dimension]),
            "unspent_p50": pct([cap - h for h in highest if h <= cap], 50),
            "counter_vs_ledger_max": {d: max((g[1] for g in gaps if g[0] == d), default=0.0) for d in LEDGER_FIELD},
            "ledger_vs_client_max": {d: max((g[2] for g in gaps if g[0] == d), default=0.0) for d in LEDGER_FIELD},
            "codes": _codes(mine),
        }
    return out


def _codes(mine: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in mine:
        for code, n in r["refusal_codes"].items():
            out[code] = out.get(code, 0) + int(n)
    return dict(sorted(out.items()))


def totals(raw: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per dimension, over every run of every round: the ledger's total, the sum of the counters and
    the client's total."""
    out: dict[str, dict[str, float]] = {}
    for dim in LEDGER_FIELD:
        triples = [spends(r, dim) for r in runs(raw) if dim in r["counter"] or dim in r["loose"]]
        out[dim] = {
            "counters": sum(t[0] for t in triples),
            "ledger": sum(t[1] for t in triples),
            "client": sum(t[2] for t in triples),
        }
    return out


def per_round(raw: Mapping[str, Any]) -> list[tuple[str, int, int, int, float]]:
    """(seed, calls, refused, runs over their cap, largest overshoot as a share of the cap)."""
    out = []
    for seed, rows in raw["rounds"].items():
        worst = 0.0
        over = 0
        for r in rows:
            dimension, cap = raw["caps"][r["tenant"]]
            excess = max(spends(r, dimension)) - cap
            worst = max(worst, excess / cap)
            over += excess > EPS[dimension]
        out.append((seed, sum(r["sent"] for r in rows), sum(r["refused"] for r in rows), over, worst))
    return out


def _v(value: float | None, dimension: str) -> str:
    if value is None:
        return "n/a"
    if dimension == "usd_per_run":
        return f"${value:.4f}"
    return f"{value:,.0f}"


def _pc(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def render(
    raw: Mapping[str, Any], summary: Mapping[str, Mapping[str, Any]], plot_name: str, reading: Sequence[str]
) -> str:
    args = raw["args"]
    pool = raw["pool"]
    seeds = list(raw["rounds"])
    lines = [
        "# Agent run budgets across two gateway replicas: overshoot",
        "",
        "`.venv/bin/python -m bench.agents.budgets"
        + f" --seeds {args['seeds']} --programs {args['programs']} --width {args['width']} --turns {args['turns']}`"
        + (" (--quick)" if args.get("quick") else ""),
        "",
        f"Two `tokenway serve` replicas on one private Redis (`state: redis`, `fail_closed`), each with its own"
        f" ledger files; {pool['engines']} simulated {pool['preset']} engines (`max_num_seqs` {pool['max_num_seqs']},"
        f" time scale {args['time_scale']}). Price ${raw['price']['input_per_mtok']} /"
        f" ${raw['price']['output_per_mtok']} per million input / output tokens. Per round (seed), "
        f"{args['programs']} agent runs, a third per tenant, each a τ²-bench retail session (at most"
        f" {args['turns']} turns) sent {args['width']} calls per turn at once, a turn's calls alternating between"
        f" the replicas, runs starting within {args['stagger_s']} s of each other; every run plays all its turns,"
        f" refused or not. Rounds (seeds): {', '.join(seeds)}. Machine: {raw['machine']}.",
        "",
        "Each tenant's runs have one tight cap (below) and a loose rule of every kind (so all three counters"
        " of every run are kept). A run's spend is read from the gateways' counter (`GET /v1/key?program=`,"
        " asked of the replica its first call did not go to), from the ledger's records of the run (both"
        " replicas' files, read after they stopped) and from what the client was told (`x-tokenway-cost-usd`,"
        " `usage`). **Overshoot** = the largest of the three less the cap. Target: 0 for every run.",
        "",
        "| tenant: cap | runs (capped) | calls sent | served | refused (429) | other errors | turns with a refusal |"
        " spent / cap p50 | max | runs over cap | largest overshoot | unspent p50 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tenant, row in summary.items():
        dim = row["dimension"]
        cap_text = _v(row["cap"], dim) + ("" if dim == "usd_per_run" else f" {UNIT[dim]}")
        lines.append(
            f"| {tenant}: `{dim}` {cap_text} | {row['runs']} ({row['runs_capped']}) | {row['sent']:,} |"
            f" {row['served']:,} | {row['refused']:,} | {row['errors']} | {row['refused_turns']} |"
            f" {_pc(row['spent_share_p50'])} | {_pc(row['spent_share_max'])} | {row['runs_over']} |"
            f" {_v(row['overshoot_max'], dim)} | {_v(row['unspent_p50'], dim)} |"
        )
    lines += [
        "",
        "*largest overshoot* is negative when every run stayed under its cap (the closest one's distance);"
        " *unspent* is what a run left of its cap once its calls no longer fit (a call's reservation is priced"
        " at its full `max_tokens` answer).",
        "",
        "Agreement (largest gap of one run, every run's three counters; the counters round calls and tokens"
        " to 0.001 and dollars to 1e-6):",
        "",
        "| tenant | counter vs ledger: $ | tokens | calls | ledger vs client: $ | tokens | calls |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tenant, row in summary.items():
        cl, lc = row["counter_vs_ledger_max"], row["ledger_vs_client_max"]
        lines.append(
            f"| {tenant} | {cl['usd_per_run']:.6f} | {cl['tokens_per_run']:,.0f} | {cl['calls_per_run']:,.0f} |"
            f" {lc['usd_per_run']:.6f} | {lc['tokens_per_run']:,.0f} | {lc['calls_per_run']:,.0f} |"
        )
    total = totals(raw)
    lines += [
        "",
        "Totals over every run of every round:",
        "",
        "| | counters (sum) | ledger | client |",
        "| --- | --- | --- | --- |",
    ]
    for dim, row in total.items():
        cells = [
            f"${row[k]:.6f}" if dim == "usd_per_run" else f"{row[k]:,.0f}" for k in ("counters", "ledger", "client")
        ]
        lines.append(f"| {UNIT[dim]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per round:",
        "",
        "| seed | calls | refused | runs over cap | largest overshoot / cap |",
        "| --- | --- | --- | --- | --- |",
    ]
    for seed, sent, refused, over, worst in per_round(raw):
        lines.append(f"| {seed} | {sent:,} | {refused:,} | {over} | {100 * worst:+.2f} % |")
    lines += [
        "",
        "Answers other than 200 by error code (`:run cap` where the message says the cap does not reset;"
        " other errors with their status first):",
        "",
    ]
    for tenant, row in summary.items():
        codes = ", ".join(f"`{c}` {n}" for c, n in row["codes"].items()) or "none"
        lines.append(f"- {tenant}: {codes}")
    over_total = sum(row["runs_over"] for row in summary.values())
    count = sum(row["runs"] for row in summary.values())
    verdict = "meets" if over_total == 0 else "misses"
    lines += [
        "",
        f"**{over_total} of {count} runs spent past their cap: {verdict} the target of 0.**",
        "",
        f"![each run's spend over its cap]({plot_name})",
        "",
        *reading,
    ]
    return "\n".join(lines)


def plot(raw: Mapping[str, Any], summary: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    tenants = list(summary)
    for i, tenant in enumerate(tenants):
        dimension, cap = raw["caps"][tenant]
        mine = [r for r in runs(raw) if r["tenant"] == tenant]
        for j, (label, colour) in enumerate(
            (("counter", "tab:blue"), ("ledger", "tab:orange"), ("client", "tab:green"))
        ):
            ys = [spends(r, dimension)[j] / cap for r in mine]
            xs = i + (j - 1) * 0.25 + rng.uniform(-0.08, 0.08, len(ys))
            ax.scatter(xs, ys, s=10, color=colour, alpha=0.6, label=label if i == 0 else None)
    ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="cap (target: no point above)")
    ax.set_xticks(range(len(tenants)), [f"{t}: {raw['caps'][t][0]}" for t in tenants])
    ax.set_ylabel("run's spend / its cap")
    ax.set_title("Each run's spend over its cap, two replicas, every round")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(raw: dict[str, Any], out: Path) -> None:
    summary = summarize(raw)
    png = out.with_suffix(".png")
    out.write_text(render(raw, summary, png.name, notes.section(out)))
    plot(raw, summary, png)
    print(out.read_text())
