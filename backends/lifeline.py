"""A child process that must not outlive the process that started it, even a `kill -9`ed one.

Nothing runs in a parent killed with SIGKILL, so its children have to notice on their own. Two ways,
both set up by `die_with_parent` in the child (e.g. as a `ProcessPoolExecutor` initializer):

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the child the
  moment the thread that forked it ends. That thread is the parent's main thread here (the event
  loop submits the work), so it fires when the parent dies; if the parent died before the child got
  this far, the signal is never sent, hence the check of the parent's pid right after.
- A watchdog thread that polls the parent's pid and exits the child once it changes (re-parented to
  init or a subreaper): the fallback where prctl is missing (macOS) or was not set.

A child killed this way lets `multiprocessing`'s resource tracker (another child of the parent,
whose pipe the workers hold open) see end-of-file and exit too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0


def die_with_parent(parent_pid: int, *, watch_interval_s: float = WATCH_INTERVAL_S) -> None:
    """Make this process end when `parent_pid` does (call early in the child)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent is gone already
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid, watch_interval_s), name="lifeline", daemon=True).start()


def _watch(parent_pid: int, interval_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(1)
