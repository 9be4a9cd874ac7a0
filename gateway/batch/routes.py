"""The Files and Batch APIs: `/v1/files*` and `/v1/batches*`, in OpenAI's shapes.

Files and batches belong to the API key that made them: another key's id answers 404 exactly as an
unknown one does (nothing leaks, not even existence), and so does anything not shaped like one of
the gateway's own random ids (it is looked up nowhere). Storage is bounded per tenant (files, bytes,
batches; `batch.tenant` in gateway.yaml). A batch input file is checked line by line as it is
uploaded (`scan_file`, below): a file with bad lines is refused with a 400 whose `error.errors`
lists them (line, code, message, param).

Every call on these routes, reads included, is one request against the request limits (RPM, RPD)
of the calling key and its tenant (`Admission.admit_request`), charged once before the handler
reads or looks up anything: a key over its RPM cannot make the gateway read an upload.

## The input file, line by line (`scan_file`)

A batch input file, checked line by line as it is uploaded.

Each non-blank line must be one JSON object `{"custom_id", "method": "POST", "url", "body"}`:
`custom_id` a non-empty string unique in the file, `url` one of the batch endpoints, `body` a valid
request for that endpoint (the same checks the endpoint applies to a live request, its nesting bound
included; `stream` is refused: a batch line's answer is written to a file). Every bad line is reported with its line
number, a code, a message and the parameter at fault — the first `max_errors` of them in full, the
rest counted. The scan also notes which urls and models the file uses (and the first line of each),
so creating a batch can say which line does not fit it without reading the file again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import orjson
from aiohttp import BodyPartReader, web
from redis.exceptions import OutOfMemoryError, RedisError

from gateway.apis.responses import ResponsesCall
from gateway.app import keys as appkeys
from gateway.batch.objects import (
    COMPLETION_WINDOW,
    ENDPOINTS,
    BatchMeta,
    FileMeta,
    file_object,
    is_batch_id,
    is_file_id,
    new_batch_id,
    new_file_id,
    page,
)
from gateway.batch.setup import BATCH, BatchService
from gateway.batch.store import QuotaExceeded
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    InvalidRequest,
    Rejected,
    RequestTooLarge,
    StorageFailed,
    error_response,
)
from gateway.http.bodies import MAX_JSON_DEPTH, check_depth, parse_json_body
from gateway.http.shapes import validate_body
from gateway.request.intake import request_id
from policies.types import Principal, Rejection, Usage

log = logging.getLogger(__name__)

MAX_CUSTOM_ID_CHARS: Final = 512
_READ_CHUNK: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class LineError:
    line: int  # 1-based, as an editor numbers the file
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message, "param": self.param}


def _check_responses(body: Any) -> dict[str, Any]:
    return ResponsesCall(None).parse(body)


def _validator(api: str) -> Callable[[Any], dict[str, Any]]:
    if api == "responses":
        return _check_responses

    def check(body: Any) -> dict[str, Any]:
        return validate_body(api, body)  # type: ignore[arg-type]

    return check


_VALIDATORS: Final = {url: _validator(api) for url, api in ENDPOINTS.items()}


def check_line(raw: bytes) -> tuple[dict[str, Any] | None, tuple[str, str, str | None] | None]:
    """(the parsed line, None) or (None, (code, message, param)) for one line of the file."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, ("invalid_json", f"the line is not valid JSON: {exc}", None)
    if not isinstance(line, dict):
        return None, ("invalid_request", "each line must be a JSON object", None)
    try:  # the body is bounded as a live request's is (one level more: the line around it)
        check_depth(line, MAX_JSON_DEPTH + 1)
    except GatewayError as exc:
        return None, ("too_deep", exc.message, exc.param)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, ("missing_custom_id", "'custom_id' is required and must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return None, ("invalid_custom_id", f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id")
    if line.get("method") != "POST":
        return None, ("invalid_method", f"'method' must be \"POST\", got {line.get('method')!r}", "method")
    url = line.get("url")
    validate = _VALIDATORS.get(url) if isinstance(url, str) else None
    if validate is None:
        return None, ("invalid_url", f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        return None, ("invalid_body", "'body' must be a JSON object (the request)", "body")
    try:
        validate(body)
    except GatewayError as exc:
        return None, ("invalid_body", exc.message, f"body.{exc.param}" if exc.param else "body")
    if body.get("stream"):
        return None, (
            "invalid_body",
            "'stream' is not supported in a batch: answers are written to a file",
            "body.stream",
        )
    return line, None


@dataclass(slots=True)
class FileScan:
    """The running result of checking a file, fed one physical line at a time."""

    max_lines: int
    max_errors: int = 100
    lines: int = 0  # requests (non-blank lines) seen
    physical: int = 0
    urls: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0
    _ids: dict[bytes, int] = field(default_factory=dict)  # digest of custom_id -> first line

    def feed(self, raw: bytes) -> None:
        self.physical += 1
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            if self.lines == self.max_lines + 1:
                self._error("too_many_lines", f"a batch file holds at most {self.max_lines} requests", None)
            return
        line, problem = check_line(raw)
        if problem is not None:
            self._error(*problem)
            return
        assert line is not None
        digest = hashlib.blake2b(line["custom_id"].encode(), digest_size=16).digest()
        first = self._ids.setdefault(digest, self.physical)
        if first != self.physical:
            self._error(
                "duplicate_custom_id",
                f"'custom_id' {line['custom_id'][:80]!r} is already used on line {first}",
                "custom_id",
            )
            return
        self.urls.setdefault(line["url"], self.physical)
        self.models.setdefault(str(line["body"]["model"]), self.physical)

    def _error(self, code: str, message: str, param: str | None) -> None:
        self.error_count += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(LineError(self.physical, code, message, param))

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.lines > 0

    def summary(self) -> str:
        """One message for the whole file (the per-line errors travel beside it)."""
        if self.lines == 0 and not self.error_count:
            return "The file holds no requests: a batch file is JSONL, one request per line."
        shown = "; ".join(f"line {e.line}: {e.message}" for e in self.errors[:3])
        more = f" (and {self.error_count - 3} more)" if self.error_count > 3 else ""
        return f"{self.error_count} line(s) of the batch file are invalid: {shown}{more}."


def scan_file(path: Path, max_lines: int, max_errors: int = 100) -> tuple[FileScan, array[int]]:
    """Check every line of the file at `path` (blocking: run it in a worker thread) and note where each
    request's line lies: (offset, length) pairs, request by request, for reading line N later."""
    scan = FileScan(max_lines=max_lines, max_errors=max_errors)
    spans: array[int] = array("Q")
    offset = 0  # of the first byte of `pending`
    pending = b""
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(_READ_CHUNK)
            if not chunk:
                break
            pending += chunk
            start = 0
            while (end := pending.find(b"\n", start)) >= 0:
                _feed(scan, spans, pending[start:end], offset + start)
                start = end + 1
            offset += start
            pending = pending[start:]
    if pending:
        _feed(scan, spans, pending, offset)
    return scan, spans


def _feed(scan: FileScan, spans: array[int], raw: bytes, offset: int) -> None:
    line = raw[:-1] if raw.endswith(b"\r") else raw
    before = scan.lines
    scan.feed(line)
    if scan.lines > before and scan.lines <= scan.max_lines:
        spans.append(offset)
        spans.append(len(line))


_READ: Final = 1 << 16
_FORM_FIELD_BYTES: Final = 1024
_MIN_EXPIRY_S, _MAX_EXPIRY_S = 3600, 2_592_000


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class QuotaError(GatewayError):
    """The tenant's batch storage is full: retrying will not help until something is deleted."""

    status = 429
    type = "invalid_request_error"
    code = "storage_quota_exceeded"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message, code=code, headers=[("x-should-retry", "false")])


class InvalidBatchFile(InvalidRequest):
    code = "invalid_batch_file"

    def __init__(self, message: str, errors: Sequence[LineError], count: int) -> None:
        super().__init__(message, param="file")
        self.errors = [e.as_dict() for e in errors]
        self.count = count

    def body(self) -> dict[str, object]:
        body = super().body()
        error = body["error"]
        assert isinstance(error, dict)
        error["errors"] = self.errors
        error["error_count"] = self.count
        return body


def _request_id(request: web.Request) -> str:
    return request_id(request.headers)  # the walk's safe reader: never echoes undecodable or long ids


def _principal(request: web.Request, service: BatchService) -> Principal:
    auth = request.headers.get("Authorization")
    key: str | None = None
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            key = token.strip()
    if key is None and request.headers.get("x-api-key"):
        key = request.headers["x-api-key"].strip()
    if not key:
        raise InvalidApiKey(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
        )
    principal = service.policies.current.authenticate(key)
    if principal is None:
        raise InvalidApiKey("Incorrect API key provided.")
    return principal


def _json(payload: Any, request_id: str, status: int = 200) -> web.Response:
    response = web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")
    response.headers["x-request-id"] = request_id
    return response


async def _charge_request(request: web.Request, principal: Principal) -> tuple[tuple[str, str], ...]:
    """One request against the key's and its tenant's request limits (RPM, RPD; never tokens), as
    count_tokens is counted: before anything is read or looked up, so a key over its RPM cannot
    make the gateway read an upload. A 429 in OpenAI's shape (Retry-After, x-ratelimit-*) when spent;
    else the x-ratelimit-* headers for the answer. Charged once per request (no retry here)."""
    admission = request.app.get(appkeys.ADMISSION)
    if admission is None:  # an app without the admission stage (unit tests of the routes alone)
        return ()
    route = request.match_info.route.resource
    label = f"{request.method} {route.canonical if route is not None else request.path}"
    admitted = await admission.admit_request(principal, label)
    if isinstance(admitted, Rejection):
        raise Rejected(admitted)
    await admission.settle(admitted, Usage(), model="")  # requests buckets: nothing to correct
    return admitted.headers


_LIMITS: Final = web.RequestKey("tokenway_batch_limits", tuple)  # the charge's x-ratelimit-* headers


def _handler(work: Any) -> Any:
    """Authenticate, charge one request to the key's rate limits, run, and answer any GatewayError in
    OpenAI's shape with the request id (and the rate-limit headers, once charged)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        request_id = _request_id(request)
        service = request.app[BATCH]
        limits: tuple[tuple[str, str], ...] = ()
        try:
            if service is None:
                raise NotFound("The Files and Batch APIs are disabled on this gateway (batch.enabled: false).")
            principal = _principal(request, service)
            limits = request[_LIMITS] = await _charge_request(request, principal)
            answer: web.StreamResponse = await work(request, service, principal, request_id)
        except GatewayError as error:
            return error_response(error, [*limits, ("x-request-id", request_id)])
        except (ConnectionError, TimeoutError):
            raise  # the client went away, or a deadline's own answer: not the store's
        except (OSError, RedisError) as exc:  # the store refused (a full disk, Redis away or full): not the request
            log.warning("batch store: %s %s failed: %s", request.method, request.path, exc)
            return error_response(_storage_failed(exc), [*limits, ("x-request-id", request_id)])
        if not answer.prepared:  # the content download wrote them before it streamed
            for name, value in limits:
                answer.headers[name] = value
        return answer

    return handle


def _storage_failed(exc: OSError | RedisError) -> StorageFailed:
    what = "the file or the batch"
    if isinstance(exc, OSError):
        return StorageFailed.of(exc, what)
    if isinstance(exc, OutOfMemoryError):
        return StorageFailed.full(what, "the batch store's Redis is full (maxmemory)")
    return StorageFailed(f"The gateway cannot store {what}: the batch store's Redis is not answering; retry later.")


T = TypeVar("T")


def _paginate(
    request: web.Request, items: list[T], ids: Iterable[str], default: int, most: int
) -> tuple[list[T], bool]:
    query = request.query
    raw = query.get("limit")
    try:
        limit = int(raw) if raw is not None else default
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {most}, got {raw!r}", param="limit")
    start = 0
    after = query.get("after")
    if after:
        index = {item_id: i for i, item_id in enumerate(ids)}.get(after)
        start = index + 1 if index is not None else len(items)
    return items[start : start + limit], start + limit < len(items)


# --- files ------------------------------------------------------------------------------------------
async def _create_file(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    settings = service.settings
    limit = settings.max_file_bytes
    if request.content_length is not None and request.content_length > limit + _READ:
        raise RequestTooLarge(f"the file exceeds the limit of {limit} bytes", code="file_too_large")
    if not request.content_type.startswith("multipart/"):
        raise InvalidRequest("upload the file as multipart/form-data with fields 'file' and 'purpose'", param="file")
    scratch = service.store.scratch()
    path = scratch / f"upload-{os.urandom(8).hex()}"
    try:
        form, filename, size = await _read_upload(request, path, limit)
        purpose = form.get("purpose")
        if purpose != "batch":
            raise InvalidRequest(
                f"'purpose' must be 'batch' (got {purpose!r}): this gateway keeps batch files only", param="purpose"
            )
        if filename is None:
            raise InvalidRequest("the form has no 'file' part", param="file")
        ttl_s = _expiry(form, settings.file_ttl_s)
        scan, spans = await asyncio.to_thread(scan_file, path, settings.max_lines)
        if not scan.ok:
            raise InvalidBatchFile(scan.summary(), scan.errors, scan.error_count)
        now = int(time.time())
        meta = FileMeta(
            id=new_file_id(),
            owner=principal.key_id,
            tenant=principal.tenant,
            filename=filename,
            purpose="batch",
            bytes=size,
            created_at=now,
            expires_at=int(now + ttl_s),
            lines=scan.lines,
            urls=scan.urls,
            models=scan.models,
        )
        tenant = settings.tenant
        try:
            await service.store.add_file(meta, path, spans, limits=(tenant.max_files, tenant.max_bytes))
        except QuotaExceeded as exc:
            raise QuotaError(f"{exc}; delete files to make room") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(path.unlink)
    return _json(file_object(meta), request_id)


async def _read_upload(request: web.Request, path: Path, limit: int) -> tuple[dict[str, str], str | None, int]:
    """Stream the multipart form: the file part to `path` (at most `limit` bytes), the small fields
    into a dict."""
    reader = await request.multipart()
    form: dict[str, str] = {}
    filename: str | None = None
    size = 0
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise InvalidRequest("nested multipart forms are not supported", param="file")
        name = part.name
        _plain(name, "name")
        if name == "file" and filename is None:
            filename = _plain(part.filename, "filename") or "upload.jsonl"
            with open(path, "wb") as fh:  # noqa: ASYNC230 - 64 KiB writes between network reads
                while chunk := await part.read_chunk(_READ):
                    size += len(chunk)
                    if size > limit:
                        raise RequestTooLarge(f"the file exceeds the limit of {limit} bytes", code="file_too_large")
                    fh.write(chunk)
            continue
        data = b""
        while chunk := await part.read_chunk(_FORM_FIELD_BYTES):
            data += chunk
            if len(data) > _FORM_FIELD_BYTES:
                raise InvalidRequest(f"the form field {name!r} is too long", param=str(name))
        if name:
            form[str(name)] = data.decode("utf-8", "replace")
    return form, filename, size


_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


def _plain(value: str | None, what: str) -> str | None:
    """`value` (a part's name or filename), refused when it holds a control character: raw CR, LF
    or NUL cannot reach here (the form's reader refuses the header), but an RFC 2231 `name*=` or
    `filename*=` may percent-encode them, and a filename is echoed in every File object."""
    if value is not None and _CONTROL.search(value):
        raise InvalidRequest(
            f"a form part's {what} may not contain control characters (CR, LF, NUL...): {value[:80]!r}", param="file"
        )
    return value


def _expiry(form: dict[str, str], default_s: float) -> float:
    anchor = form.get("expires_after[anchor]")
    seconds = form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    if anchor != "created_at":
        raise InvalidRequest("'expires_after.anchor' must be 'created_at'", param="expires_after.anchor")
    try:
        value = int(seconds or "")
    except ValueError:
        value = 0
    if not _MIN_EXPIRY_S <= value <= _MAX_EXPIRY_S:
        raise InvalidRequest(
            f"'expires_after.seconds' must be from {_MIN_EXPIRY_S} to {_MAX_EXPIRY_S}", param="expires_after.seconds"
        )
    return float(value)


async def _owned_file(service: BatchService, principal: Principal, file_id: str) -> FileMeta:
    meta = await service.store.get_file(file_id) if is_file_id(file_id) else None
    if meta is None or meta.owner != principal.key_id:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return meta


async def _list_files(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    files = await service.store.list_files(principal.key_id)
    purpose = request.query.get("purpose")
    if purpose:
        files = [f for f in files if f.purpose == purpose]
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    if order == "asc":
        files.reverse()
    chunk, more = _paginate(request, files, (f.id for f in files), 10_000, 10_000)
    return _json(page([file_object(f) for f in chunk], more), request_id)


async def _get_file(request: web.Request, service: BatchService, principal: Principal, request_id: str) -> web.Response:
    meta = await _owned_file(service, principal, request.match_info["file_id"])
    return _json(file_object(meta), request_id)


async def _file_content(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.StreamResponse:
    meta = await _owned_file(service, principal, request.match_info["file_id"])
    if await service.store.content_bytes(meta.id) != meta.bytes:  # the record outlived its bytes (a damaged store):
        raise NotFound(f"The content of file {meta.id} is no longer stored", param="file_id")  # never a cut answer
    response = web.StreamResponse(
        headers={"Content-Type": "application/jsonl", "x-request-id": request_id, **dict(request.get(_LIMITS, ()))}
    )
    response.content_length = meta.bytes
    await response.prepare(request)
    async for chunk in service.store.content(meta.id):
        await response.write(chunk)
    await response.write_eof()
    return response


async def _delete_file(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    meta = await _owned_file(service, principal, request.match_info["file_id"])
    user = await service.batch_reading(meta.id)
    if user is not None:
        raise InvalidRequest(
            f"The file {meta.id} is the input of batch {user}, which has not finished; cancel it first.",
            param="file_id",
        )
    await service.store.delete_file(meta.id)
    return _json({"id": meta.id, "object": "file", "deleted": True}, request_id)


# --- batches ----------------------------------------------------------------------------------------
async def _create_batch(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    body = parse_json_body(await request.read())
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:  # a list or object is not hashable
        shown = repr(endpoint)[:80]
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {shown}", param="endpoint")
    if body.get("completion_window") != COMPLETION_WINDOW:
        raise InvalidRequest(
            f"'completion_window' must be '{COMPLETION_WINDOW}', got {body.get('completion_window')!r}",
            param="completion_window",
        )
    metadata = _metadata(body.get("metadata"))
    output_ttl_s = _output_expiry(body.get("output_expires_after"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("'input_file_id' is required", param="input_file_id")
    meta_file = await service.store.get_file(file_id) if is_file_id(file_id) else None
    if meta_file is None or meta_file.owner != principal.key_id:
        raise NotFound(f"No such File object: {file_id}", param="input_file_id")
    if meta_file.purpose != "batch":
        raise InvalidRequest(
            f"The file {file_id} has purpose '{meta_file.purpose}', not 'batch'.", param="input_file_id"
        )
    await service.make_room(principal.tenant)
    now = int(time.time())
    meta = BatchMeta(
        id=new_batch_id(),
        owner=principal.key_id,
        tenant=principal.tenant,
        endpoint=str(endpoint),
        input_file_id=file_id,
        created_at=now,
        expires_at=int(now + service.settings.completion_window_s),
        total=meta_file.lines,
        metadata=metadata,
        output_ttl_s=output_ttl_s,
    )
    await service.store.add_batch(meta)
    service.wake()
    return _json(await service.render(meta), request_id)


def _output_expiry(value: Any) -> float | None:
    if value is None:
        return None
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise InvalidRequest("'output_expires_after.anchor' must be 'created_at'", param="output_expires_after.anchor")
    if not isinstance(seconds, int) or not _MIN_EXPIRY_S <= seconds <= _MAX_EXPIRY_S:
        raise InvalidRequest(
            f"'output_expires_after.seconds' must be from {_MIN_EXPIRY_S} to {_MAX_EXPIRY_S}",
            param="output_expires_after.seconds",
        )
    return float(seconds)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise InvalidRequest("'metadata' must be an object of at most 16 string pairs", param="metadata")
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > 512:
            raise InvalidRequest(
                "'metadata' keys are strings of at most 64 characters, values strings of at most 512", param="metadata"
            )
    return dict(value)


async def _owned_batch(service: BatchService, principal: Principal, batch_id: str) -> BatchMeta:
    meta = await service.store.get_batch(batch_id) if is_batch_id(batch_id) else None
    if meta is None or meta.owner != principal.key_id:
        raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
    return meta


async def _list_batches(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    batches = await service.store.list_batches(principal.key_id)
    chunk, more = _paginate(request, batches, (b.id for b in batches), 20, 100)
    return _json(page([await service.render(b) for b in chunk], more), request_id)


async def _get_batch(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    meta = await _owned_batch(service, principal, request.match_info["batch_id"])
    return _json(await service.render(meta), request_id)


async def _cancel_batch(
    request: web.Request, service: BatchService, principal: Principal, request_id: str
) -> web.Response:
    meta = await _owned_batch(service, principal, request.match_info["batch_id"])
    if meta.status not in ("cancelling", "cancelled"):
        moved = await service.store.update_batch(
            meta.id, {"validating", "in_progress"}, status="cancelling", cancelling_at=int(time.time())
        )
        if moved is None:
            current = await service.store.get_batch(meta.id)
            status = current.status if current is not None else meta.status
            raise InvalidRequest(f"The batch {meta.id} is {status} and can no longer be cancelled.", param="batch_id")
        meta = moved
        service.wake()
    return _json(await service.render(meta), request_id)


def setup_batch_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", _handler(_create_file))
    app.router.add_get("/v1/files", _handler(_list_files))
    app.router.add_get("/v1/files/{file_id}", _handler(_get_file))
    app.router.add_delete("/v1/files/{file_id}", _handler(_delete_file))
    app.router.add_get("/v1/files/{file_id}/content", _handler(_file_content))
    app.router.add_post("/v1/batches", _handler(_create_batch))
    app.router.add_get("/v1/batches", _handler(_list_batches))
    app.router.add_get("/v1/batches/{batch_id}", _handler(_get_batch))
    app.router.add_post("/v1/batches/{batch_id}/cancel", _handler(_cancel_batch))
