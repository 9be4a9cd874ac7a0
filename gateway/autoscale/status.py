"""`tokenway pools status`' autoscale section: `/admin/pools` as a table, decisions under it."""

from __future__ import annotations

from typing import Any

_COLUMNS = ("pool", "role", "current", "desired", "ready", "starting", "draining", "sleeping", "stopped")


def format_pools(status: dict[str, Any], decisions: int = 5) -> str:
    """Current vs desired per pool and role, the reason, learnt start-up and the last decisions."""
    pools = status.get("pools") or []
    if not pools:
        return ""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    for pool in pools:
        for role, info in (pool.get("roles") or {}).items():
            counts = info.get("replicas") or {}
            desired = info.get("desired")
            rows.append(
                (
                    pool["name"],
                    role,
                    str(info.get("current", 0)),
                    "-" if desired is None else str(desired),
                    *(str(counts.get(k, 0)) for k in _COLUMNS[4:]),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [f"autoscale (a pass every {status.get('interval_s', 0):g} s):"]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    for pool in pools:
        lines.append(f"  {pool['name']}: {pool.get('reason', '')}")
        lines.append(
            f"      start-up {pool.get('startup_s', 0):.1f} s, wake {pool.get('wake_s', 0):.1f} s (learnt); "
            f"held {pool.get('held', 0)}; drain timeouts {pool.get('drain_timeouts', 0)}"
        )
        for floor in pool.get("floors") or []:
            when = "now" if floor.get("active") else f"in {floor.get('starts_in_s', 0):.0f} s"
            role = f" {floor['role']}" if floor.get("role") else ""
            lines.append(
                f"      floor {floor.get('min_replicas')}{role} ({floor.get('source')}) {when},"
                f" ends in {floor.get('ends_in_s', 0):.0f} s"
            )
        for decision in (pool.get("decisions") or [])[-decisions:]:
            lines.append(f"      {decision.get('current')} -> {decision.get('desired')}: {decision.get('reason', '')}")
    return "\n".join(lines) + "\n"
