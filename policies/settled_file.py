"""Reading a file that another process may be writing: only a complete, settled version is returned.

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

import os
import time
from collections.abc import Callable
from pathlib import Path

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
