"""The live policy and its reloads: one attribute (`current`) that the request path reads once, loaded from
a file read only once it has settled.

Reading a settled file is the first step of every load and reload, and the holder is its only reader.

The live policy
---------------

The live policy and its reloads: one attribute (`current`) that the request path reads once.

A reload parses and compiles the whole file first and swaps `current` only when that succeeded, so
in-flight requests keep the policy they started with and a bad file changes nothing but
`last_error` (reported on /admin/status). Bucket counters live in the store under keys derived from
each rule's identity, so rules that did not change keep their counts across a reload.

The file is read once per load, and only once it is complete (`read_settled`, below): what a
reload compares, checks and loads are the same bytes, and a file caught half-written waits.

Reading a settled file
----------------------

Reading a file that another process may be writing: only a complete, settled version is returned.

Policy files change in three ways. An editor's save-by-rename and a Kubernetes ConfigMap update
(the mounted file is a symlink through `..data`, swapped atomically) replace the file whole: a reader
sees the old or the new one. But a writer that rewrites in place (`cat > policies.yaml`, `sed -i`
on some systems, editors configured to keep the inode) truncates first and writes in several calls,
and a reader in between gets a prefix, which can be valid YAML (a prefix that stops after the first
limits loads, silently dropping the rest).

So a read is accepted only when the file has not been modified for `settle_s` (its mtime is that
old) and nothing changed while it was read (mtime, size and inode the same before and after, and as
many bytes read as the file holds). Otherwise the reader waits for it to settle, up to `max_wait_s`.
A writer that pauses longer than `settle_s` in the middle of a file can still be read half-way:
write policy files atomically (write a temporary file, then rename) to be safe from that too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.keys.directory import KeyDirectory
from policies.loader import PolicyFileError, load_policy
from policies.policy import Policy

SETTLE_S = 0.5
MAX_WAIT_S = 10.0


class UnsettledFile(Exception):
    """The file kept changing for `max_wait_s`: no complete version could be read."""


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def read_settled(
    path: str | os.PathLike[str],
    *,
    settle_s: float = SETTLE_S,
    max_wait_s: float = MAX_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The file's text, read once it is complete (see the module docstring). Raises OSError when it
    cannot be read, UnicodeDecodeError when it is not UTF-8, UnsettledFile when it never settles."""
    path = Path(path)
    deadline_s = time.monotonic() + max_wait_s
    seen: tuple[tuple[int, int, int], float] | None = None  # identity and when we first saw it
    while True:
        before = path.stat()  # follows symlinks: a ConfigMap's ..data swap is a new inode
        identity = _identity(before)
        if seen is None or seen[0] != identity:
            seen = (identity, time.monotonic())
        # settled: not modified for settle_s by its mtime, or (an mtime in the future, a coarse
        # clock) unchanged for settle_s while we watched
        if time.time() - before.st_mtime_ns / 1e9 >= settle_s or time.monotonic() - seen[1] >= settle_s:
            with open(path, "rb") as fh:
                data = fh.read()
            after = path.stat()
            if identity == _identity(after) and len(data) == after.st_size:
                return data.decode("utf-8")
            seen = None  # it changed while we read: wait a whole settle period again
        if time.monotonic() >= deadline_s:
            raise UnsettledFile(f"{path}: still being written after {max_wait_s:g}s; not loaded")
        sleep(min(0.05, settle_s))


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
