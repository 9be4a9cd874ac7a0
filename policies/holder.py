"""The live policy and its reloads: one attribute (`current`) that the request path reads once.

A reload parses and compiles the whole file first and swaps `current` only when that succeeded, so
in-flight requests keep the policy they started with and a bad file changes nothing but
`last_error` (reported on /admin/status). Bucket counters live in the store under keys derived from
each rule's identity, so rules that did not change keep their counts across a reload.

The file is read once per load, and only once it is complete (`settled_file.read_settled`): what a
reload compares, checks and loads are the same bytes, and a file caught half-written waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.keys.directory import KeyDirectory
from policies.loader import PolicyFileError, load_policy
from policies.policy import Policy
from policies.settled_file import UnsettledFile, read_settled

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    changed: bool  # the new policy differs from the running one (then, and only then, generation moves)
    errors: tuple[str, ...] = ()
    loaded_at_unix_s: float = 0.0
    generation: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "changed": self.changed,
            "errors": list(self.errors),
            "loaded_at_unix_s": self.loaded_at_unix_s,
            "generation": self.generation,
        }


@dataclass(slots=True)
class PolicyHolder:
    """Holds the running `Policy`; `reload()` re-reads `path`."""

    current: Policy
    path: Path | None = None
    loaded_at_unix_s: float = field(default_factory=time.time)
    generation: int = 1
    last_error: tuple[str, ...] = ()
    last_error_at_unix_s: float | None = None
    env: Mapping[str, str] | None = None
    # What else a policy must agree with (the pools of gateway.yaml, keys made through the API): the
    # problems that make it unusable, one message each; a policy with any is refused like a bad file.
    check: Callable[[Policy], list[str]] | None = None
    directory: KeyDirectory | None = None  # keys and tenants made through the admin API
    _last_text: str | None = None

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        env: Mapping[str, str] | None = None,
        *,
        check: Callable[[Policy], list[str]] | None = None,
        directory: KeyDirectory | None = None,
    ) -> PolicyHolder:
        """Load at startup; raises `PolicyFileError` (startup must not run without a valid policy)."""
        path = Path(path)
        text = _read_complete(path)
        holder = cls(_load(path, env, check, directory, text), path=path, env=env, check=check, directory=directory)
        holder._last_text = text
        return holder

    @property
    def policy(self) -> Policy:
        return self.current

    def reload(self) -> ReloadResult:
        """Re-read the file; swap in the new policy if valid, else keep the old one and record why."""
        if self.path is None:
            return ReloadResult(False, False, ("no policies file to reload",), self.loaded_at_unix_s, self.generation)
        text: str | None = None
        try:
            text = _read_complete(self.path)
            policy = _load(self.path, self.env, self.check, self.directory, text)
        except PolicyFileError as exc:
            self.last_error = tuple(exc.messages)
            self.last_error_at_unix_s = time.time()
            log.error("policies reload rejected, keeping generation %d:\n%s", self.generation, exc)
            return ReloadResult(False, text != self._last_text, self.last_error, self.loaded_at_unix_s, self.generation)
        self._last_text = text
        self.last_error = ()
        self.last_error_at_unix_s = None
        if policy.config == self.current.config:  # same rules (also when only comments changed)
            return ReloadResult(True, False, (), self.loaded_at_unix_s, self.generation)
        self.current = policy  # the atomic swap: readers see the old or the new policy, never a mix
        self.generation += 1
        self.loaded_at_unix_s = time.time()
        log.info("policies reloaded from %s (generation %d)", self.path, self.generation)
        return ReloadResult(True, True, (), self.loaded_at_unix_s, self.generation)

    async def reload_async(self) -> ReloadResult:
        """`reload` in a worker thread, so parsing a large file never stalls the event loop."""
        return await asyncio.to_thread(self.reload)

    def status(self) -> dict[str, Any]:
        """For /admin/status: what is running, since when, and the last rejected reload."""
        return {
            "path": str(self.path) if self.path else None,
            "generation": self.generation,
            "loaded_at_unix_s": self.loaded_at_unix_s,
            "last_error": list(self.last_error) or None,
            "last_error_at_unix_s": self.last_error_at_unix_s,
        }


def _load(
    path: Path,
    env: Mapping[str, str] | None,
    check: Callable[[Policy], list[str]] | None,
    directory: KeyDirectory | None,
    text: str,
) -> Policy:
    policy = load_policy(path, env, text=text, directory=directory)
    problems = list(check(policy)) if check is not None else []
    if directory is not None:
        problems += [f"{path}: {p}" for p in directory.conflicts(policy.config)]
    if problems:
        raise PolicyFileError(problems)
    return policy


def _read_complete(path: Path) -> str:
    try:
        return read_settled(path)
    except OSError as exc:
        raise PolicyFileError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise PolicyFileError([f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from None
    except UnsettledFile as exc:
        raise PolicyFileError([str(exc)]) from None
