"""A real L4 balancer (Debian's haproxy) in front of gateway replicas, for tests and benchmarks.

TCP mode, round robin over connections, active health checks every 200 ms (a killed replica is
out after two failed checks), and a connection that cannot reach its server is redispatched to
another. Round robin is per connection: a client that keeps one connection alive talks to one
replica, so tests that want each request on the next replica open a new connection per request.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import free_port, spawn, stop_process


@dataclass
class Balancer:
    proc: subprocess.Popen[bytes]
    port: int
    config_path: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        stop_process(self.proc)


def start_haproxy(workdir: Path, backends: Sequence[int], *, port: int | None = None) -> Balancer:
    binary = shutil.which("haproxy")
    assert binary, "haproxy is needed (Debian package haproxy; .ci/run installs it)"
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    servers = "\n".join(f"  server r{i} 127.0.0.1:{p} check inter 200ms fall 2 rise 1" for i, p in enumerate(backends))
    config = f"""global
  maxconn 8192
defaults
  mode tcp
  timeout connect 2s
  timeout client 300s
  timeout server 300s
  retries 3
  option redispatch
frontend replicas
  bind 127.0.0.1:{port}
  default_backend gateways
backend gateways
  balance roundrobin
{servers}
"""
    config_path = workdir / "haproxy.cfg"
    config_path.write_text(config)
    log_path = workdir / "haproxy.log"
    with open(log_path, "wb") as log:
        proc = spawn([binary, "-db", "-f", str(config_path)], stdout=log, stderr=subprocess.STDOUT)
    balancer = Balancer(proc, port, config_path, log_path)
    import socket

    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited: {log_path.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return balancer
        if time.monotonic() > deadline:
            balancer.stop()
            raise RuntimeError("haproxy did not listen in time")
        time.sleep(0.05)
