"""Ports for launched replicas: HTTP, KV-event publishers, KV-transfer side channels.

Explicit ports (a pool's `port_base`) are claimed first; automatic ones are handed out upwards from a
base, skipping ports already claimed and, at launch time, ports something else is listening on. A
plan (no launching) assumes every port is free, so it is deterministic.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from backends.errors import PlanError

PortProbe = Callable[[str, int], bool]


def is_port_free(host: str, port: int) -> bool:
    """True when nothing is bound to (host, port): a bind test, released at once."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers bind (SO_REUSEADDR): connections in TIME_WAIT do not make a port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError:
            return False
    return True


def assume_free(host: str, port: int) -> bool:
    return True


class PortBook:
    """Every port given out in one plan, with its owner, so no two uses share one."""

    def __init__(self, is_free: PortProbe = assume_free) -> None:
        self._owner: dict[int, str] = {}
        self._cursor: dict[int, int] = {}  # base -> next candidate
        self._is_free = is_free

    def claim(self, port: int, owner: str) -> int:
        """An explicit port; two claims of one port are a configuration error."""
        if not 0 < port < 65536:
            raise PlanError(f"{owner}: port {port} is out of range")
        if port in self._owner:
            raise PlanError(f"{owner}: port {port} is already used by {self._owner[port]}")
        self._owner[port] = owner
        return port

    def take(self, base: int, host: str, owner: str) -> int:
        """The next automatic port at or above `base` that is unclaimed and free on `host`."""
        port = self._cursor.get(base, base)
        while port < 65536:
            if port not in self._owner and self._is_free(host, port):
                self._owner[port] = owner
                self._cursor[base] = port + 1
                return port
            port += 1
        raise PlanError(f"{owner}: no free port at or above {base}")
