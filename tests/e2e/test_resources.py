"""A gateway process out of disk or file descriptors (its own limits lowered with prlimit(2)): every
request answered, served or refused with a status that says so, no engine blamed, nothing lost once
the resource is back (bench/chaos/resources.py; docs/security.md "A host that runs out")."""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path

import orjson
import pytest

from bench.chaos import resources
from bench.chaos.common import ADMIN, KEY, MODEL, ledger_tally, until
from bench.chaos.surfaces import request

pytestmark = pytest.mark.e2e


def test_the_resources_probe_meets_its_targets(tmp_path: Path) -> None:
    result = resources.run(tmp_path, examples=24)
    assert resources.met(result), result


def _accepted(pid: int, port: int, client_port: int) -> bool:
    """Whether process `pid` holds its end of the connection from `client_port` to its `port` (the
    socket's inode in /proc/net/tcp among its descriptors). Counting its descriptors instead misreads
    an accept that coincides with another descriptor's close (a health probe's, a file's)."""
    wanted = f":{port:04X}", f":{client_port:04X}"
    inode = None
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(wanted[0]) and fields[2].endswith(wanted[1]):
                inode = fields[9]
    if inode is None:
        return False
    held = f"socket:[{inode}]"
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == held:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def _answer(sock: socket.socket) -> tuple[int, dict[str, object]]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():  # one chunk holds the whole error
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, orjson.loads(body)


def test_a_full_disk_serves_requests_and_refuses_files_with_507(tmp_path: Path) -> None:
    """The disk is full before the first request: chat is served (the vocabulary was read at start,
    nothing is copied to the temporary directory), an upload is refused 507, a key write 503, and
    the chat's record reaches the ledger once the disk is back."""
    with resources.Stack(tmp_path) as stack:
        limits = resources.Limits(stack.gw.proc.pid)
        limits.lower("disk", 0)
        try:
            chat = resources.send(stack, "chat", "resources-full-chat")
            upload = resources.send(stack, "upload", "resources-full-upload")
            made = resources.send(stack, "keycreate", "resources-full-key")
        finally:
            limits.lift()
        assert chat[0] == 200, chat
        assert (upload[0], resources.refusal(upload[1])) == (507, ("server_error", "insufficient_storage"))
        assert (made[0], resources.refusal(made[1])[1]) == (503, "store_unavailable")
        ledger = tmp_path / "usage"
        assert until(lambda: "resources-full-chat" in ledger_tally(ledger, "resources-")[0], timeout_s=15)
        assert ledger_tally(ledger, "resources-")[0] == {"resources-full-chat": 1}
        assert resources.send(stack, "upload", "resources-after-upload")[0] == 200
        assert "Traceback" not in stack.gw.log().split("usage ledger write to", 1)[0]


def test_no_descriptor_for_an_engine_is_a_503_that_blames_no_engine(tmp_path: Path) -> None:
    """A client connection already accepted, then no descriptor left: the engine connection cannot
    be opened. The answer is 503 `overloaded` with `retry-after`, not a 502 after ejecting healthy
    engines and trying the fallback model."""
    with resources.Stack(tmp_path) as stack:
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        pid = stack.gw.proc.pid
        limits = resources.Limits(pid)
        with socket.create_connection(("127.0.0.1", stack.gw.port), timeout=30) as sock:
            sock.sendall(head + body[:-1])  # the gateway accepts it and waits for the body's last byte
            client_port = sock.getsockname()[1]
            assert until(lambda: _accepted(pid, stack.gw.port, client_port), timeout_s=10, interval_s=0.05)
            # the limit is on descriptor numbers: at 3 (stdin, stdout, stderr) no new one can be had, even
            # where one the gateway held meanwhile was closed; those open stay open
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, limits.nofile[1]))
            try:
                sock.sendall(body[-1:])
                status, answer = _answer(sock)
            finally:
                limits.lift()
        assert status == 503, answer  # the first request: no pooled engine connection to reuse
        error = answer["error"]
        assert isinstance(error, dict) and (error["type"], error["code"]) == ("server_error", "overloaded"), error
        status, _, raw = request(stack.gw.port, "GET", "/admin/backends", {"Authorization": f"Bearer {ADMIN}"})
        states = [e["state"] for p in orjson.loads(raw)["pools"] for e in p["endpoints"]]
        assert status == 200 and set(states) == {"ready"}, states
        assert not any(marker in stack.gw.log() for marker in resources.BLAMED)
        assert resources.send(stack, "chat", "resources-after-chat")[0] == 200
