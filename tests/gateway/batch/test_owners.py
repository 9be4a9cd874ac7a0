"""A batch runs as the key that created it, whichever kind of key that is: one from policies.yaml or
one made through the admin API (the key directory) — and as nobody once that key is revoked or
expired, exactly as a request with it would be refused."""

from __future__ import annotations

from typing import Any

import yaml

from gateway.batch.runner import owner_principal
from policies.keys.directory import KeyDirectory
from policies.keys.store import MemoryDirectoryStore
from policies.loader import parse_config
from policies.policy import Policy, hash_key

POLICY: dict[str, Any] = {
    "tenants": {"files": {}},
    "keys": [
        {"id": "file-key", "tenant": "files", "sha256": hash_key("file-secret")},
        {"id": "off", "tenant": "files", "sha256": hash_key("off-secret"), "disabled": True},
    ],
    "models": {"llama-3.1-8b": {}},
}


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now_s


async def test_file_keys_and_api_keys_both_have_an_owner_principal() -> None:
    clock = Clock()
    directory = KeyDirectory(MemoryDirectoryStore(), clock=clock)
    await directory.start()
    policy = Policy(parse_config(yaml.safe_dump(POLICY)), directory=directory)
    try:
        _, secret = await directory.create_key({"tenant": "files", "id": "api-key"}, policy, ["llama-3.1-8b"])
        await directory.create_key({"tenant": "files", "id": "short", "expires_in": "1h"}, policy, ["llama-3.1-8b"])
        await directory.create_key({"tenant": "files", "id": "gone"}, policy, ["llama-3.1-8b"])

        file_owner = owner_principal(policy, "file-key")
        assert file_owner is not None and file_owner.key_id == "file-key"
        api_owner = owner_principal(policy, "api-key")
        assert api_owner is not None and api_owner.key_id == "api-key" and api_owner.source == "api"
        assert api_owner == policy.authenticate(secret)  # what a request with the key is

        await directory.revoke_key("gone")
        assert owner_principal(policy, "gone") is None
        assert owner_principal(policy, "off") is None  # disabled in the file
        assert owner_principal(policy, "nobody") is None
        assert owner_principal(policy, "short") is not None
        clock.now_s += 7200
        assert owner_principal(policy, "short") is None  # expired
    finally:
        await directory.stop()


def test_without_a_directory_only_file_keys_are_owners() -> None:
    policy = Policy(parse_config(yaml.safe_dump(POLICY)))
    assert owner_principal(policy, "file-key") is not None
    assert owner_principal(policy, "api-key") is None
