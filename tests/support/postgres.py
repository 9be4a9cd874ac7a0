"""A throwaway PostgreSQL cluster for tests: Debian's binaries, a data directory in /tmp, a free port.

`initdb` (trust authentication, superuser `tokenway`, no fsync) then `postgres` itself in the
foreground as a registered process (procs.spawn), so the suite's sweep ends it even when a test
fails; `stop()` shuts it down fast (SIGINT) and deletes the directory. PostgreSQL refuses to run as
root: as root (CI, these machines) both run as Debian's `postgres` user (else `nobody`), and the data
directory is theirs.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procs import free_port, spawn, stop_process

INSTALL = "apt-get install -y postgresql"


def binaries() -> Path | None:
    """The newest installed server's bin directory (TOKENWAY_POSTGRES_BIN overrides), or None."""
    override = os.environ.get("TOKENWAY_POSTGRES_BIN")
    if override:
        return Path(override) if (Path(override) / "initdb").is_file() else None
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(v) if (v := Path(p).parts[-3]).isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    datadir: Path
    port: int

    @property
    def dsn(self) -> str:
        return f"postgresql://tokenway@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        stop_process(self.proc, sig=signal.SIGINT, timeout_s=20)  # SIGINT: the fast shutdown
        shutil.rmtree(self.datadir, ignore_errors=True)


def _run_as() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    raise RuntimeError("running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL")


def start(bindir: Path, timeout_s: float = 60.0) -> Cluster:
    """initdb a new cluster and start it on 127.0.0.1 and a unix socket in its own directory."""
    import psycopg

    as_user = _run_as()
    datadir = Path(tempfile.mkdtemp(prefix="tokenway-pg-"))
    if as_user:
        os.chown(datadir, as_user["user"], as_user["group"])
    env = {**os.environ, "LC_ALL": "C", "HOME": str(datadir)}
    pgdata = datadir / "data"
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(pgdata), "-U", "tokenway", "--auth=trust", "-E", "UTF8",
         "--locale=C", "--no-sync"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=datadir, **as_user,
    )  # fmt: skip
    port = free_port()
    proc = spawn(
        [str(bindir / "postgres"), "-D", str(pgdata), "-p", str(port), "-h", "127.0.0.1", "-k", str(datadir),
         "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off"],
        stdout=subprocess.DEVNULL, stderr=open(datadir / "postgres.log", "wb"),  # noqa: SIM115
        env=env, cwd=datadir, **as_user,
    )  # fmt: skip
    cluster = Cluster(proc, datadir, port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            psycopg.connect(cluster.dsn, connect_timeout=2).close()
            return cluster
        except psycopg.OperationalError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (datadir / "postgres.log").read_text(errors="replace")[-2000:]
                cluster.stop()
                raise RuntimeError(f"PostgreSQL did not start (exit {proc.returncode}):\n{log}") from None
            time.sleep(0.1)
