"""The key directory: keys and tenants made through the API authenticate, carry their own limits,
rotate with a grace period, expire, revoke, and never collide with policies.yaml's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.holder import PolicyHolder
from policies.keys.directory import DirectoryError, KeyDirectory
from policies.keys.store import MemoryDirectoryStore, Snapshot, SqliteDirectoryStore
from policies.limits.plan import SPEND_RULE_ID
from policies.loader import PolicyFileError, parse_config
from policies.policy import Policy, hash_key

POLICY: dict[str, Any] = {
    "tenants": {"files": {"priority": "high"}},
    "keys": [{"id": "file-key", "tenant": "files", "sha256": hash_key("file-secret")}],
    "models": {"llama-3.1-8b": {"aliases": ["gpt-4o-mini"], "price": {"input_per_mtok": 1, "output_per_mtok": 2}}},
    "limits": [{"id": "every-key", "scope": "key", "rpm": 60, "tpm": 1000}],
}
MODELS = ["llama-3.1-8b"]


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now_s


def policy(directory: KeyDirectory, doc: dict[str, Any] | None = None) -> Policy:
    return Policy(parse_config(yaml.safe_dump(doc or POLICY)), directory=directory)


async def made(clock: Clock | None = None) -> tuple[KeyDirectory, Policy]:
    directory = KeyDirectory(MemoryDirectoryStore(), clock=clock or Clock())
    await directory.start()
    return directory, policy(directory)


async def test_a_created_key_authenticates_with_its_secret_only() -> None:
    directory, p = await made()
    await directory.create_tenant({"name": "acme", "priority": "low"}, p, MODELS)
    record, secret = await directory.create_key({"tenant": "acme", "id": "k1", "models": ["gpt-4o-mini"]}, p, MODELS)
    principal = p.authenticate(secret)
    assert principal is not None and principal.key_id == "k1" and principal.tenant == "acme"
    assert principal.allowed_models == frozenset({"llama-3.1-8b"})  # the alias, resolved
    assert principal.priority == -1 and principal.source == "api"
    assert p.authenticate(secret + "x") is None
    assert record.sha256 == hash_key(secret) and secret not in record.model_dump_json()
    assert p.authenticate("file-secret") is not None  # the file's keys still work
    await directory.stop()


async def test_create_refuses_unknown_tenants_taken_ids_and_unknown_models() -> None:
    directory, p = await made()
    with pytest.raises(DirectoryError) as missing:
        await directory.create_key({"tenant": "nobody"}, p, MODELS)
    assert missing.value.status == 404 and missing.value.param == "tenant"
    with pytest.raises(DirectoryError) as taken:
        await directory.create_key({"tenant": "files", "id": "file-key"}, p, MODELS)
    assert taken.value.status == 409
    with pytest.raises(DirectoryError) as model:
        await directory.create_key({"tenant": "files", "models": ["gpt-5"]}, p, MODELS)
    assert model.value.status == 400 and "gpt-5" in str(model.value)
    with pytest.raises(DirectoryError) as field:
        await directory.create_key({"tenant": "files", "limits": {"rpm": 0}}, p, MODELS)
    assert field.value.status == 400 and field.value.param == "limits.rpm"
    with pytest.raises(DirectoryError) as tenant:
        await directory.create_tenant({"name": "files"}, p, MODELS)
    assert tenant.value.status == 409
    await directory.stop()


async def test_own_limits_override_the_files_rule_and_spend_is_counted() -> None:
    directory, p = await made()
    _, secret = await directory.create_key(
        {"tenant": "files", "id": "k1", "limits": {"rpm": 5, "usd_per_day": 2}}, p, MODELS
    )
    principal = p.authenticate(secret)
    assert principal is not None
    plan = p.admission_plan(principal, "llama-3.1-8b")
    by_dimension = {(b.dimension, b.rule_id): b.capacity for b in plan.buckets}
    assert by_dimension == {("rpm", "@api-key"): 5.0, ("tpm", "every-key"): 1000.0}  # rpm own, tpm the file's
    budgets = {(b.period, b.rule_id, b.shadow) for b in plan.budgets}
    assert budgets == {("day", "@api-key", False), ("month", SPEND_RULE_ID, True)}  # month spend still counted
    await directory.stop()


async def test_patch_changes_the_plan_of_the_next_request() -> None:
    directory, p = await made()
    _, secret = await directory.create_key({"tenant": "files", "id": "k1", "limits": {"rpm": 5}}, p, MODELS)
    first = p.authenticate(secret)
    assert first is not None
    await directory.patch_key("k1", {"limits": {"rpm": 7, "tpm": 300}, "metadata": {"owner": "ann"}}, p, MODELS)
    second = p.authenticate(secret)
    assert second is not None and second.revision != first.revision
    caps = {b.dimension: b.capacity for b in p.admission_plan(second, "llama-3.1-8b").buckets}
    assert caps == {"rpm": 7.0, "tpm": 300.0}
    assert directory.keys["k1"].metadata.owner == "ann" and directory.keys["k1"].revision == 2
    await directory.patch_key("k1", {"limits": {"tpm": None}}, p, MODELS)  # null removes one limit
    third = p.authenticate(secret)
    assert third is not None
    caps = {b.dimension: b.capacity for b in p.admission_plan(third, "llama-3.1-8b").buckets}
    assert caps == {"rpm": 7.0, "tpm": 1000.0}
    await directory.stop()


async def test_revoked_and_expired_keys_stop_authenticating() -> None:
    clock = Clock()
    directory, p = await made(clock)
    _, revoked = await directory.create_key({"tenant": "files", "id": "r"}, p, MODELS)
    _, expiring = await directory.create_key({"tenant": "files", "id": "e", "expires_in": "1h"}, p, MODELS)
    assert p.authenticate(revoked) is not None and p.authenticate(expiring) is not None
    await directory.revoke_key("r")
    assert p.authenticate(revoked) is None
    with pytest.raises(DirectoryError):
        await directory.revoke_key("r")  # already revoked
    clock.now_s += 3601
    assert p.authenticate(expiring) is None
    assert directory.keys["e"].status(clock.now_s) == "expired"
    await directory.stop()


async def test_rotation_keeps_the_old_secret_for_the_grace_period() -> None:
    clock = Clock()
    directory, p = await made(clock)
    _, old = await directory.create_key({"tenant": "files", "id": "k1"}, p, MODELS)
    _, new = await directory.rotate_key("k1", {"grace_s": 60})
    assert new != old
    assert p.authenticate(new) is not None and p.authenticate(old) is not None
    clock.now_s += 61
    assert p.authenticate(old) is None and p.authenticate(new) is not None
    _, newest = await directory.rotate_key("k1", {"grace_s": 0})  # no grace: the previous one dies now
    assert p.authenticate(new) is None and p.authenticate(newest) is not None
    await directory.stop()


async def test_tenant_changes_reach_its_keys_and_deleting_a_used_tenant_is_refused() -> None:
    directory, p = await made()
    await directory.create_tenant({"name": "acme"}, p, MODELS)
    _, secret = await directory.create_key({"tenant": "acme", "id": "k1"}, p, MODELS)
    await directory.patch_tenant("acme", {"limits": {"tpm": 100}, "priority": "critical"}, p, MODELS)
    principal = p.authenticate(secret)
    assert principal is not None and principal.priority == 2
    plan = p.admission_plan(principal, "llama-3.1-8b")
    assert {(b.scope, b.dimension, b.capacity) for b in plan.buckets if b.rule_id == "@api-tenant"} == {
        ("tenant", "tpm", 100.0)
    }
    with pytest.raises(DirectoryError) as used:
        await directory.delete_tenant("acme")
    assert used.value.status == 409 and "k1" in str(used.value)
    await directory.revoke_key("k1")
    await directory.delete_tenant("acme")
    assert "acme" not in directory.tenants
    await directory.stop()


@pytest.mark.slow
async def test_a_key_id_in_both_the_file_and_the_directory_is_refused_at_load(tmp_path: Path) -> None:
    directory, p = await made()
    await directory.create_key({"tenant": "files", "id": "taken"}, p, MODELS)
    doc = dict(POLICY, keys=[*POLICY["keys"], {"id": "taken", "tenant": "files", "sha256": hash_key("other")}])
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PolicyFileError) as refused:
        PolicyHolder.from_file(path, directory=directory)
    assert "'taken' is also a key made through the admin API" in str(refused.value)
    path.write_text(yaml.safe_dump(POLICY))
    holder = PolicyHolder.from_file(path, directory=directory)
    path.write_text(yaml.safe_dump(doc))
    result = holder.reload()  # a reload that adds the id is refused too; the running policy stays
    assert not result.ok and any("taken" in e for e in result.errors)
    await directory.stop()


async def test_the_sqlite_store_keeps_keys_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "var" / "keys.sqlite3"
    directory = KeyDirectory(SqliteDirectoryStore(db))
    await directory.start()
    p = policy(directory)
    await directory.create_tenant({"name": "acme"}, p, MODELS)
    _, secret = await directory.create_key({"tenant": "acme", "id": "k1", "limits": {"tpm": 9}}, p, MODELS)
    _, revoked = await directory.create_key({"tenant": "acme", "id": "k2"}, p, MODELS)
    await directory.revoke_key("k2")
    assert p.authenticate(secret) is not None
    await directory.stop()  # flushes last use

    again = KeyDirectory(SqliteDirectoryStore(db))
    await again.start()
    p2 = policy(again)
    principal = p2.authenticate(secret)
    assert principal is not None and principal.key_limits is not None and principal.key_limits.tpm == 9
    assert p2.authenticate(revoked) is None
    assert again.last_use_of("k1") is not None
    assert again.version == 4
    await again.stop()


async def test_a_mirror_copy_never_goes_back_to_an_older_snapshot(tmp_path: Path) -> None:
    """The Redis store's local copy: a reload's snapshot read before a write can land after that
    write's `put`; it must not take the copy back, or a revocation lost from the copy would come back
    with it when an emptied Redis is restored from the copy."""
    copy = SqliteDirectoryStore(tmp_path / "copy.sqlite3")
    await copy.put("key", "gone", '{"revoked": false}', 2)
    await copy.put("key", "gone", '{"revoked": true}', 3)  # the revocation, version 3
    older = Snapshot(2, {"key": {"gone": '{"revoked": false}'}, "tenant": {}, "override": {}})
    await copy.replace_all(older)  # a reload that read version 2, landing late
    kept = await copy.load()
    assert kept.version == 3 and kept.docs["key"]["gone"] == '{"revoked": true}'
    await copy.replace_all(Snapshot(4, {"key": {}, "tenant": {}, "override": {}}))  # a newer one: taken
    assert (await copy.load()).version == 4
    await copy.close()
