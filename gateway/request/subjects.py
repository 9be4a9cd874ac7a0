"""What a request names beside its key: its end user, its tags, and the run budget it asks for.

Operators count spend and set limits by more than the key: per end user of an app (OpenAI's `user`),
per feature or cost centre (tags), per agent run (the program, gateway/request/program.py). These are
client input that reaches admission's counters, the ledger and the console, so each is bounded here,
once, at intake:

- **end user**: `x-tokenway-user`, else the body's `user` (OpenAI) or `safety_identifier` (OpenAI's
  newer name for it); kept like program ids (short valid text as sent, else '#' + a 128-bit hash).
- **tags**: `x-tokenway-tags` (comma-separated) and the body's `metadata.tags` (a list, or a
  comma-separated string: OpenAI's `metadata` values are strings), merged, at most `MAX_TAGS`, each
  1-64 characters of `[A-Za-z0-9_.:/-]`. A tag outside that is a 400 naming it, never silently
  dropped: a dropped tag would bill its spend to nobody.
- **run budget**: `x-tokenway-run-budget-usd`, a positive number of dollars; it lowers the agent run's
  `usd_per_run` for this program (never raises it: policies/limits/compile.py) and needs a program.
- **run wall-clock cap**: `x-tokenway-run-seconds`, a positive number of seconds from the run's first
  call; it lowers the run's `seconds_per_run` the same way, and needs a program too.

Limits and budgets apply to them only where policies.yaml has rules of scope `user`, `tag` or
`program` (docs/governance.md); the ledger records user and tags whatever the rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

from gateway.errors import InvalidRequest
from policies.routing.session import bounded_key
from policies.types import NO_SUBJECTS, RequestSubjects

USER_HEADER: Final = "x-tokenway-user"
TAGS_HEADER: Final = "x-tokenway-tags"
RUN_BUDGET_HEADER: Final = "x-tokenway-run-budget-usd"
RUN_SECONDS_HEADER: Final = "x-tokenway-run-seconds"
MAX_RUN_SECONDS: Final = 31_536_000.0  # a year: policies.yaml's bound on seconds_per_run
MAX_TAGS: Final = 8
_TAG: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}")


def request_subjects(headers: Mapping[str, str], body: Mapping[str, Any], program: str | None) -> RequestSubjects:
    """The request's end user, tags, program and run budget, bounded; a 400 for a malformed tag or
    run budget. A request naming none gets the shared empty value (no allocation)."""
    user = _user(headers, body)
    tags = _tags(headers, body)
    run_usd = _run_usd(headers.get(RUN_BUDGET_HEADER), program)
    run_s = _run_seconds(headers.get(RUN_SECONDS_HEADER), program)
    if user is None and not tags and program is None:
        return NO_SUBJECTS
    return RequestSubjects(user=user, tags=tags, program=program, run_usd=run_usd, run_s=run_s)


def _user(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    value: Any = headers.get(USER_HEADER)
    if not value:
        value = body.get("user") or body.get("safety_identifier")
    return bounded_key(value) if isinstance(value, str) and value else None


def _tags(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str, ...]:
    found: list[str] = []
    header = headers.get(TAGS_HEADER)
    if header:
        found += _split(header, TAGS_HEADER)
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        tags = metadata.get("tags")
        if isinstance(tags, str):
            found += _split(tags, "metadata.tags")
        elif isinstance(tags, list):
            if len(tags) > MAX_TAGS:
                raise InvalidRequest(f"at most {MAX_TAGS} tags, got {len(tags)}", param="metadata.tags")
            for tag in tags:
                if not isinstance(tag, str):
                    raise InvalidRequest("metadata.tags: expected strings", param="metadata.tags")
                found.append(_checked(tag.strip(), "metadata.tags"))
        elif tags is not None:
            raise InvalidRequest("metadata.tags: expected a list of strings", param="metadata.tags")
    if not found:
        return ()
    unique = tuple(sorted(set(found)))  # one order: the same tags are the same admission plan
    if len(unique) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags, got {len(unique)}", param="tags")
    return unique


def _split(value: str, where: str) -> list[str]:
    parts = [part.strip() for part in value.split(",", MAX_TAGS + 1) if part.strip()]
    if len(parts) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags in {where}", param=where)
    return [_checked(part, where) for part in parts]


def _checked(tag: str, where: str) -> str:
    if _TAG.fullmatch(tag) is None:
        shown = tag[:40] + ("..." if len(tag) > 40 else "")
        raise InvalidRequest(
            f"invalid tag {shown!r} in {where}: 1-64 characters of letters, digits and _ . : / -, "
            "starting with a letter or digit",
            param=where,
        )
    return tag


def _run_usd(value: str | None, program: str | None) -> float | None:
    if value is None:
        return None
    try:
        usd = float(value)
    except ValueError:
        usd = math.nan
    if not math.isfinite(usd) or usd <= 0:
        raise InvalidRequest(f"{RUN_BUDGET_HEADER}: expected a positive number of dollars", param=RUN_BUDGET_HEADER)
    if program is None:
        raise InvalidRequest(
            f"{RUN_BUDGET_HEADER} budgets an agent run: name the run (x-tokenway-program)", param=RUN_BUDGET_HEADER
        )
    return usd


def _run_seconds(value: str | None, program: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_RUN_SECONDS:
        raise InvalidRequest(
            f"{RUN_SECONDS_HEADER}: expected a positive number of seconds, at most {MAX_RUN_SECONDS:.0f}",
            param=RUN_SECONDS_HEADER,
        )
    if program is None:
        raise InvalidRequest(
            f"{RUN_SECONDS_HEADER} caps an agent run: name the run (x-tokenway-program)", param=RUN_SECONDS_HEADER
        )
    return seconds
