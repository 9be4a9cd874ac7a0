"""Backoff for failed console logins, per client address and across all clients.

A login is the one operator surface that takes a secret from anyone who can reach it, so guessing
must cost time: after `free_failures` wrong tokens within `window_s`, a client waits
`base_delay_s * 2^(failures - free_failures)` (capped at `max_delay_s`) before its next try is even
looked at, and is answered 429 with `Retry-After` meanwhile. The same backoff runs over all clients
together (a guesser spreading over many addresses), with a larger allowance and a shorter cap, so a
flood slows every guesser without locking the operator out for long. A success clears that
client's record (never the global one).

Memory is bounded: at most `max_clients` addresses are remembered, the least recently failing
dropped first (an attacker evicting its own records still meets the global backoff).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Record:
    failures: int
    last_failure: float
    blocked_until: float


@dataclass(frozen=True, slots=True)
class Backoff:
    free_failures: int
    base_delay_s: float
    max_delay_s: float
    window_s: float

    def delay_s(self, failures: int) -> float:
        if failures < self.free_failures:
            return 0.0
        return min(self.max_delay_s, self.base_delay_s * 2.0 ** min(failures - self.free_failures, 64))


PER_CLIENT = Backoff(free_failures=5, base_delay_s=1.0, max_delay_s=900.0, window_s=900.0)
GLOBAL = Backoff(free_failures=50, base_delay_s=0.5, max_delay_s=30.0, window_s=300.0)
MAX_CLIENTS = 4096


class LoginThrottle:
    def __init__(
        self,
        *,
        per_client: Backoff = PER_CLIENT,
        overall: Backoff = GLOBAL,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_client = per_client
        self.overall = overall
        self.max_clients = max_clients
        self._clock = clock
        self._clients: OrderedDict[str, _Record] = OrderedDict()
        self._global = _Record(0, 0.0, 0.0)

    def retry_after_s(self, client: str) -> float:
        """Seconds before `client` may try again (0: now)."""
        now = self._clock()
        record = self._clients.get(client)
        waits = [self._global.blocked_until - now]
        if record is not None:
            waits.append(record.blocked_until - now)
        return max(0.0, *waits)

    def failed(self, client: str) -> tuple[int, float]:
        """Count a wrong token; returns the client's failures in its window and its wait before the next try."""
        now = self._clock()
        record = self._clients.pop(client, None)
        if record is None or now - record.last_failure > self.per_client.window_s:
            record = _Record(0, now, 0.0)
        record.failures += 1
        record.last_failure = now
        record.blocked_until = now + self.per_client.delay_s(record.failures)
        self._clients[client] = record  # most recent last
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)
        glob = self._global
        if now - glob.last_failure > self.overall.window_s:
            glob.failures = 0
        glob.failures += 1
        glob.last_failure = now
        glob.blocked_until = now + self.overall.delay_s(glob.failures)
        return record.failures, max(record.blocked_until, glob.blocked_until) - now

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)

    def __len__(self) -> int:
        return len(self._clients)


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
