"""Hot reload of policies.yaml: watch the file, reload on SIGHUP, keep serving throughout.

`policy_reload_ctx(holder)` is a cleanup_ctx generator factory. While the app runs it polls the
file's identity (mtime, size, inode: an editor's save-by-rename changes the inode) and reloads when
it changes, and it reloads on SIGHUP. Reloads are serialised and run in a worker thread
(`PolicyHolder.reload_async`); a valid file swaps in atomically, an invalid one is logged and
recorded on the holder (reported by /admin/status) while the running policy stays. Polling, not
inotify: it works the same on every platform and in containers with bind-mounted config, and a
policy file changes rarely enough that one `stat` a second is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from backends.tasks import cancel_and_wait
from policies.holder import PolicyHolder, ReloadResult

log = logging.getLogger("tokenway.policies")

FileIdentity = tuple[int, int, int] | None  # (mtime_ns, size, inode), None when missing


def _identity(path: Path) -> FileIdentity:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class PolicyWatcher:
    """Reloads `holder` when its file changes or on SIGHUP; `reload()` is the one entry point."""

    def __init__(
        self,
        holder: PolicyHolder,
        path: Path | None = None,
        poll_interval_s: float = 1.0,
        on_reload: Callable[[ReloadResult], None] | None = None,
    ) -> None:
        self.holder = holder
        self.path = path or holder.path
        self.poll_interval_s = poll_interval_s
        self.on_reload = on_reload
        self._lock = asyncio.Lock()
        self._seen: FileIdentity = _identity(self.path) if self.path else None
        self._task: asyncio.Task[None] | None = None
        self._signal_tasks: set[asyncio.Task[ReloadResult]] = set()
        self._sighup = False

    async def reload(self, reason: str = "request") -> ReloadResult:
        """Reload now (serialised with every other reload); never raises."""
        async with self._lock:
            if self.path is not None:
                self._seen = _identity(self.path)
            result = await self.holder.reload_async()
        if result.ok:
            log.info("policies reloaded (%s): generation %d", reason, result.generation)
        else:
            log.error("policies reload (%s) rejected; keeping generation %d", reason, result.generation)
        if self.on_reload is not None:
            self.on_reload(result)
        return result

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.path is not None and self.poll_interval_s > 0:
            self._task = loop.create_task(self._poll())
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup = True
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            log.info("SIGHUP reload unavailable here (not the main thread or no signals)")

    async def stop(self) -> None:
        if self._sighup:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._task is not None:
            await cancel_and_wait([self._task], what="policy reload")
            self._task = None
        for task in list(self._signal_tasks):
            with contextlib.suppress(Exception):
                await task

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload("SIGHUP"))
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    async def _poll(self) -> None:
        assert self.path is not None
        while True:
            await asyncio.sleep(self.poll_interval_s)
            current = _identity(self.path)
            if current is not None and current != self._seen:
                await self.reload("file changed")


def policy_reload_ctx(
    holder: PolicyHolder,
    path: str | os.PathLike[str] | None = None,
    poll_interval_s: float = 1.0,
    *,
    on_reload: Callable[[ReloadResult], None] | None = None,
    watcher_key: web.AppKey[PolicyWatcher] | None = None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx generator: watch `path` (default: the holder's) while the app runs.

    With `watcher_key`, the watcher is stored on the app so `POST /admin/reload` can call
    `app[watcher_key].reload("admin")` and share its serialisation.
    """

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        watcher = PolicyWatcher(holder, Path(path) if path is not None else None, poll_interval_s, on_reload)
        if watcher_key is not None:
            app[watcher_key] = watcher
        watcher.start()
        yield
        await watcher.stop()

    return ctx
