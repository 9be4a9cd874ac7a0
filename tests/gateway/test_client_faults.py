"""A client's malformed request is answered 400 and logged at debug level, not as a server error."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

from gateway.http.connections import ClientFaults


def record(error: BaseException | None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (), exc_info)


def test_malformed_requests_are_demoted_and_real_errors_kept() -> None:
    faults = ClientFaults()
    demoted = record(BadHttpMessage("Invalid header value char"))
    assert faults.filter(demoted) is False  # debug, and debug is off for aiohttp.server here
    assert demoted.levelno == logging.DEBUG and demoted.exc_info is None
    real = record(RuntimeError("a bug"))
    assert faults.filter(real) is True and real.levelno == logging.ERROR
