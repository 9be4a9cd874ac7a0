"""Port allocation: explicit claims, automatic ports skipping claimed and busy ones."""

from __future__ import annotations

import socket

import pytest

from backends.plan import PortBook, is_port_free
from backends.types import PlanError


def test_automatic_ports_skip_claimed_and_busy() -> None:
    busy = {8102}
    book = PortBook(lambda host, port: port not in busy)
    book.claim(8100, "explicit")
    assert [book.take(8100, "127.0.0.1", f"r{i}") for i in range(3)] == [8101, 8103, 8104]
    assert book.take(5557, "127.0.0.1", "events") == 5557  # another base, another cursor


def test_double_claim_names_both_owners() -> None:
    book = PortBook()
    book.claim(9000, "pool 'a' replica both-0")
    with pytest.raises(PlanError, match="pool 'b' replica both-0: port 9000 is already used by pool 'a'"):
        book.claim(9000, "pool 'b' replica both-0")
    with pytest.raises(PlanError, match="out of range"):
        book.claim(70000, "x")


def test_is_port_free_sees_a_listener() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not is_port_free("127.0.0.1", port)
    assert is_port_free("127.0.0.1", port)
