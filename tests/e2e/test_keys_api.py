"""Keys and tenants through the admin API and the CLI, against real gateway processes, simulated
engines and the official openai client: a key made through the API works at once, carries its own
limits, reports its standing on /v1/key, survives a restart (SQLite), and dies when revoked — also on
a second replica sharing Redis. A key id in both policies.yaml and the directory stops start-up."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from tests.support.polling import wait_for
from tests.support.procs import REPO, Gateway, SimEngines, policies_doc, start_gateway, static_pool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA = "llama-3.1-8b"
POLICY = policies_doc(models={LLAMA: {"price": {"input_per_mtok": 100.0, "output_per_mtok": 300.0}}})
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]


def admin(gateway: Gateway, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(gateway.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def client(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


def rejected(gateway: Gateway, key: str) -> bool:
    try:
        client(gateway, key).chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=4)
    except openai.AuthenticationError:
        return True
    return False


@pytest.fixture
def engines(sim_factory: Callable[..., SimEngines]) -> SimEngines:
    return sim_factory(count=1, time_scale=50, served_model_name=LLAMA)


def test_a_key_made_through_the_api_works_reports_its_standing_and_dies_when_revoked(
    engines: SimEngines, gateway_factory: Callable[..., Gateway]
) -> None:
    gateway = gateway_factory(pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY)
    status, tenant = admin(gateway, "POST", "/admin/tenants", {"name": "acme", "limits": {"rpm": 1000}})
    assert status == 201 and tenant["source"] == "api"
    status, made = admin(gateway, "POST", "/admin/keys", {"tenant": "acme", "id": "acme-1", "limits": {"rpm": 2}})
    assert status == 201 and made["secret"].startswith("tw-")
    secret = made["secret"]
    assert secret not in json.dumps(admin(gateway, "GET", "/admin/keys")[1])  # never listed again

    reply = client(gateway, secret).chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=8)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    standing = client(gateway, secret).get("/key", cast_to=object)
    assert isinstance(standing, dict)
    data = standing["data"]
    assert data["key_id"] == "acme-1" and data["tenant"] == "acme" and data["source"] == "api"
    assert data["spend_usd"]["day"] > 0 and data["spend_usd"]["month"] == data["spend_usd"]["day"]
    rpm = next(row for row in data["limits"] if row["rule"] == "@api-key")
    assert rpm["dimension"] == "rpm" and rpm["limit"] == 2 and rpm["remaining"] < 2

    # its own rpm of 2: the third request inside the minute is a 429 naming the key
    client(gateway, secret).chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.RateLimitError) as limited:
        client(gateway, secret).chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=4)
    assert "key 'acme-1'" in str(limited.value)

    status, shown = admin(gateway, "GET", "/admin/keys/acme-1")
    assert status == 200 and shown["standing"]["spend_usd"]["day"] > 0
    assert admin(gateway, "DELETE", "/admin/keys/acme-1")[0] == 200
    assert rejected(gateway, secret)
    assert admin(gateway, "GET", "/admin/keys/acme-1")[1]["status"] == "revoked"


def test_keys_survive_a_restart_and_a_file_key_with_the_same_id_stops_start_up(
    engines: SimEngines, tmp_path: Path
) -> None:
    workdir = tmp_path / "gw"
    pools = [static_pool("p", LLAMA, engines.urls)]
    gateway = start_gateway(workdir, pools=pools, policies=POLICY)
    try:
        status, made = admin(gateway, "POST", "/admin/keys", {"tenant": "t1", "id": "survivor"})
        assert status == 201
    finally:
        gateway.stop()
    assert (workdir / "var" / "keys.sqlite3").exists()
    gateway = start_gateway(workdir, pools=pools, policies=POLICY)
    try:
        reply = client(gateway, made["secret"]).chat.completions.create(model=LLAMA, messages=MESSAGES, max_tokens=4)
        assert reply.choices
    finally:
        gateway.stop()

    clash = dict(POLICY, keys=[*POLICY["keys"], {"id": "survivor", "tenant": "t1", "sha256": "0" * 64}])
    (workdir / "policies.yaml").write_text(yaml.safe_dump(clash))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--config", str(workdir / "gateway.yaml")],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "'survivor' is also a key made through the admin API" in run.stderr


@pytest.mark.redis
def test_a_revocation_reaches_the_other_replica(
    engines: SimEngines, gateway_factory: Callable[..., Gateway], redis_url: str, redis_prefix: str
) -> None:
    state = {"backend": "redis", "redis_url": redis_url, "key_prefix": redis_prefix}
    pools = [static_pool("p", LLAMA, engines.urls)]
    a = gateway_factory(pools=pools, policies=POLICY, state=state)
    b = gateway_factory(pools=pools, policies=POLICY, state=state)
    status, made = admin(a, "POST", "/admin/keys", {"tenant": "t1", "id": "shared"})
    assert status == 201
    wait_for(lambda: not rejected(b, made["secret"]))
    assert admin(b, "GET", "/admin/keys/shared")[1]["id"] == "shared"
    assert admin(a, "DELETE", "/admin/keys/shared")[0] == 200
    wait_for(lambda: rejected(b, made["secret"]))


def test_the_cli_makes_lists_rotates_and_revokes_keys(
    engines: SimEngines, gateway_factory: Callable[..., Gateway]
) -> None:
    gateway = gateway_factory(pools=[static_pool("p", LLAMA, engines.urls)], policies=POLICY)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway.app.cli", *args, "--url", gateway.url],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = cli("keys", "create", "--tenant", "nobody")
    assert missing.returncode == 1 and "no tenant 'nobody'" in missing.stderr
    assert cli("tenants", "create", "team-a", "--tpm", "100000").returncode == 0
    made = cli("keys", "create", "--tenant", "team-a", "--id", "cli-1", "--rpm", "50", "--owner", "ann", "--json")
    assert made.returncode == 0, made.stderr
    secret = json.loads(made.stdout)["secret"]
    listing = cli("keys", "list", "--tenant", "team-a")
    assert "cli-1" in listing.stdout and "rpm=50" in listing.stdout and "ann" in listing.stdout
    assert secret not in listing.stdout
    rotated = cli("keys", "rotate", "cli-1", "--grace-s", "0")
    assert rotated.returncode == 0 and "no longer works" in rotated.stdout
    new_secret = rotated.stdout.split(": ", 1)[1].split()[0]
    assert rejected(gateway, secret) and not rejected(gateway, new_secret)
    assert cli("keys", "update", "cli-1", "--tpm", "1234").returncode == 0
    assert json.loads(cli("keys", "show", "cli-1").stdout)["limits"] == {"rpm": 50, "tpm": 1234}
    assert cli("tenants", "update", "team-a", "--rpm", "77", "--clear", "tpm").returncode == 0
    assert json.loads(cli("tenants", "show", "team-a").stdout)["limits"] == {"rpm": 77}
    assert cli("keys", "revoke", "cli-1").returncode == 0
    assert rejected(gateway, new_secret)
