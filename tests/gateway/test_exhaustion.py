"""The gateway's own shortages (file descriptors, a full disk) are told apart from an engine's failure
and from a bug: no engine is blamed for them and no request meets a 500 (bench/chaos/resources.py
drives them on a real process; these pin each decision)."""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
from typing import Any

import aiohttp
import pytest
import tiktoken.registry
from aiohttp.client_reqrep import ConnectionKey

from backends import tokenization
from backends.adapters.base import Probe
from backends.config import BackendsSettings
from backends.fleet import HealthChecker, probe
from backends.types import EndpointState
from gateway.errors import StorageFailed
from gateway.upstream.client import GatewayExhausted, UpstreamClient, UpstreamConnectionError
from tests.backends.test_health import endpoint

EMFILE = OSError(errno.EMFILE, "Too many open files")


async def test_a_connect_without_a_descriptor_is_the_gateway_s_shortage(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def no_descriptor(*args: Any, **kwargs: Any) -> Any:
        raise EMFILE

    monkeypatch.setattr(loop, "create_connection", no_descriptor)
    async with UpstreamClient() as client:
        with pytest.raises(GatewayExhausted, match="cannot open a connection"):
            await client.post("http://127.0.0.1:9/v1/chat/completions", {}, b"{}")


async def test_a_refused_connect_is_still_the_engine_s(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    monkeypatch.setattr(loop, "create_connection", refused)
    async with UpstreamClient() as client:
        with pytest.raises(UpstreamConnectionError) as raised:
            await client.post("http://127.0.0.1:9/v1/chat/completions", {}, b"{}")
    assert not isinstance(raised.value, GatewayExhausted)


class _NoDescriptorSession:
    """An aiohttp session whose connector has no descriptor left (what aiohttp raises then)."""

    def get(self, url: str, **kwargs: Any) -> Any:
        key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
        raise aiohttp.ClientConnectorError(key, EMFILE)


async def test_a_health_probe_the_gateway_could_not_send_is_no_verdict() -> None:
    ready = endpoint(engine="vllm", base_url="http://127.0.0.1:9", state=EndpointState.READY)
    assert await probe(ready, _NoDescriptorSession(), 1.0) is None  # type: ignore[arg-type]
    checker = HealthChecker(BackendsSettings())
    for _ in range(10):  # far past the failures that eject
        await checker.check(ready, _NoDescriptorSession())  # type: ignore[arg-type]
    assert ready.state is EndpointState.READY


async def test_a_health_probe_refused_still_counts() -> None:
    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)

    class Refused:
        def get(self, url: str, **kwargs: Any) -> Any:
            raise aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))

    starting = endpoint(engine="vllm", base_url="http://127.0.0.1:9", state=EndpointState.STARTING)
    assert await probe(starting, Refused(), 1.0) is Probe.STARTING  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status", "error_code"),
    [
        (errno.ENOSPC, 507, "insufficient_storage"),
        (errno.EDQUOT, 507, "insufficient_storage"),
        (errno.EFBIG, 507, "insufficient_storage"),
        (errno.EIO, 503, "storage_unavailable"),
        (errno.EMFILE, 503, "storage_unavailable"),
    ],
)
def test_a_refused_write_is_a_storage_answer_not_a_bug(code: int, status: int, error_code: str) -> None:
    error = StorageFailed.of(OSError(code, "refused"), "the file")
    assert (error.status, error.code, error.type) == (status, error_code, "server_error")
    assert error.message.startswith("The gateway cannot store the file")
    assert StorageFailed.status == 503  # the class's own status is untouched by one instance


def test_the_shared_vocabulary_loads_with_no_writable_temporary_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken copies a vocabulary it reads into the temporary directory unless told not to; with
    the disk full every first count failed (500) until one copy succeeded."""
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tokenway-no-tmp")
    monkeypatch.setattr(tempfile, "gettempdir", _no_temporary_directory)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # tiktoken's own cache: read the file again
    tokenization.encoding.cache_clear()
    try:
        assert tokenization.encoding().encode("hello world") == [15339, 1917]
        assert "TIKTOKEN_CACHE_DIR" not in os.environ  # the engines it launches inherit nothing of it
    finally:
        tokenization.encoding.cache_clear()


def _no_temporary_directory() -> str:
    raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found")
