"""The JSON replies of the gateway's own routes (admin API, console, health): one body encoding and
one error shape, so an operator's client reads every admin route's refusal the same way."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from gateway.errors import Rejected, error_response
from policies.types import Rejection

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 503: "server_error"}
_ERROR_CODES = {404: "not_found", 409: "conflict", 503: "store_unavailable"}


def json_reply(data: object, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


def admin_error(status: int, message: str, param: str | None = None) -> web.Response:
    """A refusal in OpenAI's error shape, its type and code from the status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    return error_response(Rejected(Rejection(status, message, kind, code=_ERROR_CODES.get(status), param=param)))
