"""A hosted call with a first-token deadline armed is cut over either client (transport/hosted.py):
the engine client's connection dropped, or aiohttp's call through a proxy closed, and the next read
fails as a dropped connection does (never as a clean end of the stream). Real sockets: the Anthropic
stand-in process, slow to its first token, and a forward proxy on loopback."""

from __future__ import annotations

import pytest

from gateway.upstream.client import CallWatch, UpstreamConnectionError
from gateway.upstream.replica_loss import DEADLINE
from tests.gateway.transport.test_hosted_client import CHAT, calls_to, no_proxies
from tests.sim.hosted.standin import standin
from tests.support.http_proxy import forward_proxy

__all__ = ["no_proxies"]  # the fixture, used by name


@pytest.mark.e2e  # starts the Anthropic stand-in (and a proxy)
@pytest.mark.parametrize("proxied", [False, True], ids=["direct", "proxied"])
async def test_an_armed_deadline_cuts_a_stream_that_showed_nothing(
    no_proxies: pytest.MonkeyPatch, proxied: bool
) -> None:
    with standin("anthropic", "--ttft-ms", "60000") as slow:
        async with forward_proxy() as proxy:
            no_proxies.setenv("HTTP_PROXY", proxy.url)
            if not proxied:
                no_proxies.setenv("NO_PROXY", "127.0.0.1")
            calls, endpoint = calls_to(slow.url)
            await calls.start()
            try:
                assert calls.proxied(endpoint.id) is proxied
                url, headers, body, _ = calls.prepare(endpoint, {**CHAT, "stream": True}, "req-1", "claude")
                watch = CallWatch(endpoint.id, stream=True)
                watch.arm(0.3, DEADLINE)
                response = await calls.post(url, headers, body, watch)
                assert response.status == 200
                with pytest.raises(UpstreamConnectionError):
                    while await response.next_chunk():
                        pass
                assert watch.reason == DEADLINE
            finally:
                await calls.close()
            assert bool(proxy.targets) is proxied
