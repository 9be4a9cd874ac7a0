"""Files the gateway keeps for itself, read back damaged: the one way each is set aside.

A store that finds its own file unreadable (a key store SQLite cannot read whole, a batch record that
is no record, an audit log that is no file) moves it out of the way instead of writing over it: the
operator keeps what is left of it, and nothing reads it again."""

from __future__ import annotations

import os
from pathlib import Path


def set_aside(path: Path) -> Path:
    """Move `path` (a file, or whatever stands in its place) to `<name>.corrupt-<n>`, the first `n`
    free, and return where it went. Raises OSError when it cannot be moved."""
    n = 1
    while (aside := path.with_name(f"{path.name}.corrupt-{n}")).exists() or aside.is_symlink():
        n += 1
    os.replace(path, aside)
    return aside
