"""`auth: entra` on an Azure OpenAI pool (backends/hosted/azure_openai.py, transport/hosted.py): the bearer
token is fetched off the loop at start, sent as `Authorization: Bearer` instead of `api-key`, and
refreshed off the loop before it expires. The Azure stand-in process checks it (it accepts a bearer
equal to its `--api-key`, as Azure accepts a valid Entra ID token, and refuses any other with 401).
The credential is a stand-in for azure-identity's DefaultAzureCredential with azure-core's contract:
`get_token(*scopes)` returning an `AccessToken(token, expires_on)`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import openai
import pytest
from pydantic import ValidationError

from backends.config import PoolConfig
from backends.fleet import Fleet
from backends.hosted.azure_openai import SCOPE, EntraToken
from gateway.transport.hosted import HostedCalls, HostedConfigError, Provider
from tests.backends.builders import pool
from tests.sim.hosted.standin import StandIn, standin

CHAT: dict[str, Any] = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class AccessToken(NamedTuple):  # azure-core's shape: the token and its expiry in epoch seconds
    token: str
    expires_on: int


class TokenSource:
    """Hands out `tokens` in turn (the last one again once spent), each valid `lifetime_s`."""

    def __init__(self, *tokens: str, lifetime_s: float = 3600.0, fail: bool = False) -> None:
        self.tokens, self.lifetime_s, self.fail = list(tokens), lifetime_s, fail
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.append(scopes)
        if self.fail:
            raise RuntimeError("DefaultAzureCredential failed to retrieve a token from the included credentials")
        token = self.tokens.pop(0) if len(self.tokens) > 1 else self.tokens[0]
        return AccessToken(token, int(time.time() + self.lifetime_s))


@pytest.fixture
def azure_standin() -> Iterator[StandIn]:
    with standin("azure") as running:
        yield running


def entra_pool(url: str) -> PoolConfig:
    return pool(
        name="azure",
        model="gpt",
        engine="azure-openai",
        served_model_name="dep",
        auth="entra",
        endpoints=[{"url": url}],
    )


async def started(url: str, source: TokenSource) -> tuple[HostedCalls, Provider]:
    fleet = Fleet.from_configs([entra_pool(url)])
    calls = HostedCalls(fleet, connect_timeout_s=5.0, read_timeout_s=30.0)
    (provider,) = calls.providers.values()
    provider.entra = EntraToken(source)  # in place of DefaultAzureCredential
    await calls.start()
    return calls, provider


async def ask(calls: HostedCalls, provider: Provider) -> tuple[int, dict[str, str]]:
    endpoint = next(iter(Fleet.from_configs([calls.pools["azure"]]).pools["azure"].endpoints))
    url, headers, body, _ = calls.prepare(endpoint, CHAT, "req-1", "gpt")
    async with await calls.post(url, headers, body) as response:
        await response.read()
        return response.status, headers


@pytest.mark.e2e  # starts the Azure stand-in
async def test_the_token_is_fetched_at_start_and_sent_as_a_bearer(azure_standin: StandIn) -> None:
    source = TokenSource("test-key")
    calls, provider = await started(azure_standin.url, source)
    try:
        status, headers = await ask(calls, provider)
        assert status == 200
        assert headers["authorization"] == "Bearer test-key" and "api-key" not in headers
        assert source.scopes == [(SCOPE,)]  # once, at start: not per request
        provider.refresh_soon()  # an hour left: nothing to refresh
        assert provider.refreshing is None
    finally:
        await calls.close()


@pytest.mark.e2e  # starts the Azure stand-in
async def test_a_token_close_to_expiry_is_refreshed_off_the_loop(azure_standin: StandIn) -> None:
    source = TokenSource("test-key", "next-token", lifetime_s=60.0)  # under the 5 minutes kept in hand
    calls, provider = await started(azure_standin.url, source)
    try:
        assert (await ask(calls, provider))[0] == 200
        provider.refresh_soon()
        assert provider.refreshing is not None
        await provider.refreshing
        status, headers = await ask(calls, provider)
        assert headers["authorization"] == "Bearer next-token"
        assert status == 401  # the stand-in checks the bearer: the new token is what went out
        assert len(source.scopes) >= 2  # each call while it is this close to expiry sets one refresh off
    finally:
        await calls.close()


@pytest.mark.e2e  # starts the Azure stand-in
async def test_no_token_at_start_stops_the_pool_with_its_name(azure_standin: StandIn) -> None:
    with pytest.raises(HostedConfigError, match="pool 'azure': no Entra ID token"):
        await started(azure_standin.url, TokenSource("x", fail=True))


@pytest.mark.e2e  # starts the Azure stand-in
def test_the_sdks_token_provider_path_is_accepted_by_the_same_standin(azure_standin: StandIn) -> None:
    """What Azure's docs pair with DefaultAzureCredential (`azure_ad_token_provider`), fed by EntraToken."""
    entra = EntraToken(TokenSource("test-key"))
    client = openai.AzureOpenAI(
        azure_endpoint=azure_standin.url,
        api_version="2024-10-21",
        azure_ad_token_provider=lambda: entra.refresh()[0],
        max_retries=0,
    )
    assert client.chat.completions.create(model="dep", messages=CHAT["messages"], max_tokens=8).choices


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "anthropic", "served_model_name": "c", "api_key_env": "K"}, "applies to engine `azure-openai`"),
        ({"engine": "azure-openai", "served_model_name": "d", "api_key_env": "K"}, "no `api_key_env`"),
        ({"engine": "vllm"}, "applies to engine `azure-openai`"),
    ],
)
def test_entra_is_azure_only_and_replaces_the_key(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PoolConfig.model_validate(
            {"name": "p", "model": "m", "auth": "entra", "endpoints": [{"url": "https://x.example"}], **fields}
        )
    assert entra_pool("https://r.openai.azure.com").api_key_env is None  # no key needed with entra
