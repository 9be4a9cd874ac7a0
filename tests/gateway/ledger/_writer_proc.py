"""A stand-in for a busy gateway: appends ledger records in a loop until it is killed.

Usage: python _writer_proc.py DIR COMMIT_INTERVAL_MS ROTATE_BYTES

Prints READY, then the request id of every record whose `append` returned more than one commit
interval ago (one id per line, unbuffered). The test kills the process with SIGKILL at a random
moment: every id printed before the kill must be in the ledger.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from gateway.app.settings import LedgerConfig
from gateway.ledger.writer import LedgerWriter
from tests.gateway.ledger.records import make_record


def main() -> None:
    directory, interval_ms, rotate_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    writer = LedgerWriter(LedgerConfig(dir=directory, commit_interval_ms=interval_ms, rotate_bytes=rotate_bytes))
    interval_s = interval_ms / 1000.0
    appended: deque[tuple[float, str]] = deque()
    os.write(1, b"READY\n")
    i = 0
    while True:
        record = make_record(i, started_at_unix_s=time.time())
        writer.append(record)
        appended.append((time.monotonic(), record.request_id))
        i += 1
        now = time.monotonic()
        acked = []
        while appended and now - appended[0][0] > interval_s:
            acked.append(appended.popleft()[1])
        if acked:
            os.write(1, ("\n".join(acked) + "\n").encode())
        if i % 20 == 0:
            time.sleep(0.0005)  # a few thousand records per second, the loop yielding as a gateway's does


if __name__ == "__main__":
    main()
