"""A finished batch's output and error files, written from its recorded results.

The output file holds the successful lines, the error file the others, both in the input's line
order; an expired or cancelled batch adds the lines that never ran to the error file (code
`batch_expired` / `batch_cancelled`). The two files' ids are derived from the batch id, so a
finalization cut short by a crash is simply done again: it replaces what the first one left.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from array import array
from typing import IO, Final

import orjson

from gateway.batch.objects import BatchMeta, FileMeta
from gateway.batch.store import BatchStore, unanswered

_READ: Final = 256
_UNRUN: Final = {
    "expired": ("batch_expired", "The batch's completion window ended before this request ran."),
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
}


def derived_file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


class _Out:
    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.spans: array[int] = array("Q")
        self.bytes = 0
        self.lines = 0

    def write(self, line: bytes) -> None:
        self.spans.append(self.bytes)
        self.spans.append(len(line))
        self.fh.write(line + b"\n")
        self.bytes += len(line) + 1
        self.lines += 1


async def write_outputs(
    store: BatchStore, meta: BatchMeta, ending: str, file_ttl_s: float
) -> tuple[str | None, str | None]:
    """Write the batch's output and error files; their ids (None: that file would be empty)."""
    ids = {kind: derived_file_id(meta.id, kind) for kind in ("output", "error")}
    for file_id in ids.values():
        await store.delete_file(file_id)  # what an interrupted finalization left
    scratch = store.scratch()
    paths = {kind: scratch / f"{meta.id}.{kind}.jsonl" for kind in ids}
    found: dict[str, str | None] = {}
    try:
        with open(paths["output"], "wb") as out_fh, open(paths["error"], "wb") as err_fh:  # noqa: ASYNC230
            outs = {"output": _Out(out_fh), "error": _Out(err_fh)}
            async for result in store.results(meta.id):
                outs["output" if result.ok else "error"].write(result.line)
            if ending in _UNRUN:
                code, message = _UNRUN[ending]
                missing = await store.unrecorded(meta.id)
                for start in range(0, len(missing), _READ):
                    chunk = missing[start : start + _READ]
                    for index, raw in zip(chunk, await store.read_lines(meta.input_file_id, chunk), strict=True):
                        custom_id = str(orjson.loads(raw).get("custom_id", ""))
                        outs["error"].write(unanswered(index, custom_id, code, message).line)
        now = int(time.time())
        for kind, out in outs.items():
            if not out.lines:
                found[kind] = None
                continue
            file_meta = FileMeta(
                id=ids[kind],
                owner=meta.owner,
                tenant=meta.tenant,
                filename=f"{meta.id}_{kind}.jsonl",
                purpose="batch_output",
                bytes=out.bytes,
                created_at=now,
                expires_at=int(now + file_ttl_s),
                lines=out.lines,
            )
            await store.add_file(file_meta, paths[kind], out.spans, limits=(0, 0))
            found[kind] = ids[kind]
    finally:
        for path in paths.values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return found["output"], found["error"]
