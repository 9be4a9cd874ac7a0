"""The benchmarks' load generator: streamed `/v1/completions` calls, open or closed loop.

    python -m bench.loadgen PLAN.json RESULTS.json     # in its own process (its CPU counted apart)

Open loop sends every request at its planned time, whatever the answers (a trace replay: the
arrivals are the workload, so a slow server cannot slow them down); closed loop keeps N requests
outstanding (a capacity probe). Both record, per request, what the client saw (wall seconds: TTFT =
the first chunk carrying text, TPOT over the rest, end to end), what the server said about it (the
status and error code, the `x-tokenway-endpoint` / `-prediction` / `-queued-ms` debug headers)
and what the engine reported (usage, cached prompt tokens, and the simulated engine's per-request
`metrics` from the last chunk, in engine seconds).

A plan file is `{"url", "label", "timeout_s", "shots": [{"at_s", "body", "headers"}]}`; the results
file is one `Outcome.row()` per shot, in order. Bodies are built before the clock starts, and a
stream is parsed only until its first token and at its end, so the client's own CPU stays small
beside the gateway's and the engines' on a shared host.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

COMPLETIONS = "/v1/completions"
_TEXT = re.compile(rb'"text":"[^"]')  # a completion chunk with a non-empty text
_TAIL_BYTES = 16384  # the last events of a stream: usage, metrics, an error


@dataclass(frozen=True, slots=True)
class Shot:
    """One request to send: when (seconds after the start, open loop), what, with which headers."""

    at_s: float
    body: bytes
    headers: dict[str, str]


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    """A streamed completion of exactly `max_tokens` tokens (`ignore_eos`), with usage at the end."""
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
    )


def bearer(key: str, *, debug: bool = False) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if debug:
        headers["x-tokenway-debug"] = "1"  # the gateway's prediction and queueing as response headers
    return headers


@dataclass(slots=True)
class Outcome:
    """What one request did. Times are wall seconds; `engine` is in the engine's own seconds."""

    index: int
    scheduled_s: float = 0.0  # planned send time after the start (closed loop: when it was sent)
    late_s: float = 0.0  # how late it was sent (the client's own lag)
    status: int = 0
    code: str = ""  # error code of a non-200 (slo_unattainable, ...), a transport error, or stream_error
    message: str = ""
    ttft_s: float | None = None  # None: no token came back
    tpot_s: float | None = None  # None: fewer than two tokens
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""  # x-tokenway-endpoint
    queued_ms: float = 0.0  # x-tokenway-queued-ms
    prediction: dict[str, float] = field(default_factory=dict)  # x-tokenway-prediction: ttft, ttft_p90, tpot, tpot_p90
    prediction_source: str = ""
    engine: dict[str, float] = field(default_factory=dict)  # the simulated engine's `metrics`

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft_s is not None and not self.code

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def parse_prediction(header: str | None) -> tuple[dict[str, float], str]:
    """`ttft=..;ttft_p90=..;tpot=..;tpot_p90=..;source=..` → (values in ms, source)."""
    values: dict[str, float] = {}
    source = ""
    for part in (header or "").split(";"):
        name, _, value = part.partition("=")
        if name == "source":
            source = value
        elif name in ("ttft", "ttft_p90", "tpot", "tpot_p90"):
            values[name] = float(value)
    return values, source


def _events(data: bytes) -> list[dict[str, Any]]:
    """The complete JSON data events of an SSE byte run (a cut event at either end is skipped)."""
    out: list[dict[str, Any]] = []
    for event in data.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data: {"):
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(event[6:]))
    return out


def _has_text(buffer: bytes) -> bool:
    return any(c.get("text") for chunk in _events(buffer) for c in chunk.get("choices") or ())


async def send(session: aiohttp.ClientSession, url: str, shot: Shot, out: Outcome) -> None:
    """One streamed completion; fills `out` (never raises for what the server or network did)."""
    start = time.perf_counter()
    first = last = 0.0
    head = tail = b""
    try:
        async with session.post(url, data=shot.body, headers=shot.headers) as resp:
            out.status = resp.status
            out.endpoint = resp.headers.get("x-tokenway-endpoint", "")
            out.prediction, out.prediction_source = parse_prediction(resp.headers.get("x-tokenway-prediction"))
            out.queued_ms = float(resp.headers.get("x-tokenway-queued-ms", 0) or 0)
            if resp.status != 200:
                raw = await resp.read()
                try:
                    error = orjson.loads(raw).get("error") or {}
                except (orjson.JSONDecodeError, AttributeError):
                    error = {"message": raw[:200].decode(errors="replace")}
                out.code = str(error.get("code") or resp.status)
                out.message = str(error.get("message", ""))[:200]
                out.e2e_s = time.perf_counter() - start
                return
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                if not first:
                    head += data
                    if b'"text":"' in head and _has_text(head):
                        first = last = now
                        head = b""
                elif _TEXT.search(tail[-8:] + data):  # 8 bytes: a pattern cut between reads, never a whole one
                    last = now
                tail = (tail + data)[-_TAIL_BYTES:]
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.code, out.message = type(exc).__name__, str(exc)[:200]
    out.e2e_s = time.perf_counter() - start
    for chunk in reversed(_events(tail)):
        if "error" in chunk:
            out.code, out.message = "stream_error", str(chunk["error"])[:200]
        usage = chunk.get("usage")
        if usage:
            out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            out.completion_tokens = int(usage.get("completion_tokens") or 0)
            out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            metrics = chunk.get("metrics")
            if isinstance(metrics, dict):
                out.engine = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
            break
    if first:
        out.ttft_s = first - start
        if out.completion_tokens > 1:  # 0.0 when every token came in the first read
            out.tpot_s = (last - first) / (out.completion_tokens - 1)


@dataclass(slots=True)
class ChatStream:
    """What a streamed chat completion said, as far as it was read: a timeout that cuts the read keeps
    what had come (the TTFT of a request that then timed out is still a TTFT)."""

    error: bool = False  # the stream carried an error event
    ttft_s: float | None = None  # to the first chunk with content
    finish: str = ""  # the last finish reason
    usage: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # the simulated engine's, beside the usage


@dataclass(slots=True)
class ChatCall:
    """One streamed chat completion as the client saw it (`chat_completion`)."""

    status: int = 0  # 0: no answer (a transport error or the client's timeout)
    code: str = ""  # a refusal's error code, stream_error, client_timeout, client_error:<exception>
    e2e_s: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: ChatStream = field(default_factory=lambda: ChatStream())


async def chat_completion(
    session: aiohttp.ClientSession, url: str, data: bytes, headers: Mapping[str, str], timeout_s: float
) -> ChatCall:
    """POST `data` to `url`/v1/chat/completions and read the answer's stream, giving up after
    `timeout_s` (as users do); never raises for what the server or the network did."""
    call = ChatCall()
    start = time.perf_counter()
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(url + "/v1/chat/completions", data=data, headers=headers) as resp,
        ):
            call.status, call.headers = resp.status, resp.headers
            if resp.status != 200:
                call.code = await error_code(resp)
                return call
            await read_chat_stream(resp, start, call.stream)
    except TimeoutError:
        call.code = "client_timeout"
    except aiohttp.ClientError as exc:
        call.code = f"client_error:{type(exc).__name__}"
    finally:
        call.e2e_s = time.perf_counter() - start
        call.code = call.code or ("stream_error" if call.stream.error else "")
    return call


async def error_code(resp: aiohttp.ClientResponse) -> str:
    """The `error.code` of a refused request's body ("unparsable" when it is not JSON)."""
    try:
        return str((orjson.loads(await resp.read()).get("error") or {}).get("code") or "")
    except orjson.JSONDecodeError:
        return "unparsable"


async def read_chat_stream(resp: aiohttp.ClientResponse, start: float, seen: ChatStream) -> None:
    """Reads a `/v1/chat/completions` stream line by line into `seen`, until its end or an error
    event; `start` is the `perf_counter` the TTFT counts from. (The completions client above parses
    less, to keep its own CPU small; the chat clients want the finish reason and every usage field.)"""
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            seen.error = True
            return
        for choice in chunk.get("choices") or ():
            if seen.ttft_s is None and (choice.get("delta") or {}).get("content"):
                seen.ttft_s = time.perf_counter() - start
            if choice.get("finish_reason"):
                seen.finish = str(choice["finish_reason"])
        usage = chunk.get("usage")
        if usage:
            seen.usage = usage
            metrics = chunk.get("metrics")
            seen.metrics = metrics if isinstance(metrics, dict) else {}


class Progress:
    """One status line on stderr, at most every few seconds."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.sent = self.done = self.errors = 0
        self.t0 = self._last = time.perf_counter()

    def show(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 5.0:
            return
        self._last = now
        sys.stderr.write(
            f"\r  {self.label:<28} sent {self.sent}/{self.total} done {self.done} "
            f"errors {self.errors} {now - self.t0:5.0f}s"
        )
        sys.stderr.flush()

    def finish(self) -> None:
        self.show(force=True)
        sys.stderr.write("\n")


async def open_loop(arrivals_s: Sequence[float], start: Callable[[int], Coroutine[Any, Any, None]]) -> list[float]:
    """Start `start(i)` at `arrivals_s[i]` seconds after now, whatever the earlier ones are doing,
    and wait for all of them; returns how late each was started (the caller's own lag)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    late: list[float] = []
    tasks: list[asyncio.Task[None]] = []
    for i, at in enumerate(arrivals_s):
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        late.append(max(0.0, loop.time() - t0 - at))
        tasks.append(asyncio.create_task(start(i)))
    await asyncio.gather(*tasks)
    return late


def _session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
    )


async def replay(
    base_url: str, shots: Sequence[Shot], *, label: str = "replay", timeout_s: float = 1800.0
) -> list[Outcome]:
    """Open loop: every shot sent `at_s` after the start."""
    url = base_url.rstrip("/") + COMPLETIONS
    outcomes = [Outcome(i, scheduled_s=s.at_s) for i, s in enumerate(shots)]
    progress = Progress(len(shots), label)
    async with _session(timeout_s) as session:

        async def one(i: int) -> None:
            progress.sent += 1
            await send(session, url, shots[i], outcomes[i])
            progress.done += 1
            progress.errors += not outcomes[i].ok
            progress.show()

        late = await open_loop([s.at_s for s in shots], one)
    for out, lag in zip(outcomes, late, strict=True):
        out.late_s = lag
    progress.finish()
    return outcomes


async def closed_loop(
    base_url: str, shots: Sequence[Shot], concurrency: int, *, label: str = "closed loop", timeout_s: float = 900.0
) -> list[Outcome]:
    """`concurrency` requests outstanding until every shot was sent (`at_s` ignored)."""
    url = base_url.rstrip("/") + COMPLETIONS
    outcomes = [Outcome(i) for i in range(len(shots))]
    progress = Progress(len(shots), label)
    pending = list(range(len(shots)))[::-1]
    t0 = time.perf_counter()
    async with _session(timeout_s) as session:

        async def worker() -> None:
            while pending:
                i = pending.pop()
                outcomes[i].scheduled_s = time.perf_counter() - t0
                progress.sent += 1
                await send(session, url, shots[i], outcomes[i])
                progress.done += 1
                progress.errors += not outcomes[i].ok
                progress.show()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    progress.finish()
    return outcomes


def write_plan(path: Path, base_url: str, shots: Sequence[Shot], *, label: str, timeout_s: float = 1800.0) -> None:
    shots_json = [{"at_s": s.at_s, "body": orjson.Fragment(s.body), "headers": s.headers} for s in shots]
    plan = {"url": base_url, "label": label, "timeout_s": timeout_s, "shots": shots_json}
    path.write_bytes(orjson.dumps(plan))


def read_plan(path: Path) -> tuple[str, list[Shot], str, float]:
    plan = orjson.loads(path.read_bytes())
    shots = [Shot(float(s["at_s"]), orjson.dumps(s["body"]), dict(s["headers"])) for s in plan["shots"]]
    return plan["url"], shots, str(plan.get("label", "replay")), float(plan.get("timeout_s", 1800.0))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    url, shots, label, timeout_s = read_plan(Path(args[0]))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    outcomes = asyncio.run(replay(url, shots, label=label, timeout_s=timeout_s))
    Path(args[1]).write_bytes(orjson.dumps([o.row() for o in outcomes]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
