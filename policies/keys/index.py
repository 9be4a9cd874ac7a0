"""The in-memory index of the keys and tenants made through the admin API: what the hot path reads.

Authentication of such a key is one dictionary lookup by SHA-256 digest (after the file's keys),
a constant-time comparison, an expiry check and a cached principal: the store is never touched per
request. Principals are compiled against the running policy (a file tenant's models and priority,
alias resolution) on first use after a change or a policy reload, and cached on the entry. The
index changes only by applying stored documents (`apply_doc`, `replace`), whoever wrote them: this
replica (`policies/keys/directory.py`) or another one (`follow` and `poll` below, over a shared store).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from policies.keys.records import KeyRecord, OverrideRecord, TenantRecord
from policies.keys.store import DirectoryStore, Kind, Snapshot
from policies.schema import PRIORITY_VALUES, PoliciesConfig, TenantConfig
from policies.types import Principal

if TYPE_CHECKING:
    from policies.policy import Policy

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    record: KeyRecord
    digest: bytes
    valid_until_s: float | None  # a rotated-out secret's grace deadline; None for the current one
    policy: Policy | None = None  # the policy `principal` was compiled against
    principal: Principal | None = None


class KeyIndex:
    """Keys by digest and tenants by name, as the store holds them; `KeyDirectory` adds the writes."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.keys: dict[str, KeyRecord] = {}
        self.tenants: dict[str, TenantRecord] = {}
        self.overrides: dict[str, OverrideRecord] = {}  # temporary limit overrides (policies/limits/plan.py)
        self.overrides_generation = 0  # bumped by every change of `overrides`: admission plans are rebuilt
        self._by_digest: dict[str, _Entry] = {}
        self._used: dict[str, float] = {}  # key id -> last use not yet written to the store
        self.version = 0
        self.seen_version = 0  # the last announcement applied in order (shared stores)
        self._compiles = 0
        self._listeners: list[Callable[[], None]] = []
        self.stats = {"reloads": 0, "applied": 0, "sync_errors": 0}

    def on_change(self, listener: Callable[[], None]) -> None:
        """Called after any key or tenant changes (e.g. to widen the metrics' tenant allow-list)."""
        self._listeners.append(listener)

    # ------------------------------------------------------------------ the hot path
    def authenticate(self, digest: bytes, hex_digest: str, policy: Policy) -> Principal | None:
        entry = self._by_digest.get(hex_digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            return None
        now_s = self._clock()
        record = entry.record
        if record.expires_at_unix_s is not None and now_s >= record.expires_at_unix_s:
            return None
        if entry.valid_until_s is not None and now_s >= entry.valid_until_s:
            return None
        if entry.policy is not policy:
            entry.principal = self._compile(record, policy)
            entry.policy = policy
        if entry.principal is not None:
            self._used[record.id] = now_s
        return entry.principal

    def _compile(self, record: KeyRecord, policy: Policy) -> Principal | None:
        config = policy.config
        file_tenant = config.tenants.get(record.tenant)
        api_tenant = None if file_tenant is not None else self.tenants.get(record.tenant)
        tenant: TenantConfig | TenantRecord | None = file_tenant or api_tenant
        if tenant is None:
            return None  # its tenant is gone: the key authenticates nothing until one exists again
        self._compiles += 1
        return Principal(
            key_id=record.id,
            tenant=record.tenant,
            allowed_models=config.allowed_models(tenant.models, record.models),
            priority=PRIORITY_VALUES[record.priority or tenant.priority],
            allow_fallback=tenant.allow_fallback,
            key_limits=record.limits.own(),
            tenant_limits=api_tenant.limits.own() if api_tenant is not None else None,
            revision=self._compiles,
            track_spend=True,
            slo_class=api_tenant.slo_class if api_tenant is not None else None,
            source="api",
            show_cost=file_tenant.show_cost if file_tenant is not None else False,
            team=tenant.team,
        )

    def principal(self, key_id: str, policy: Policy) -> Principal | None:
        """The principal of an API key by id, whatever its state (the console's standing view)."""
        record = self.keys.get(key_id)
        return self._compile(record, policy) if record is not None else None

    # ------------------------------------------------------------------ checks against the file
    def conflicts(self, config: PoliciesConfig) -> list[str]:
        """What makes a policies file and this directory disagree: the same key id or tenant name in
        both, and API keys whose tenant neither defines."""
        file_keys = {k.id for k in config.keys}
        problems = [
            f"keys: id {key_id!r} is also a key made through the admin API; rename or revoke one"
            for key_id in sorted(file_keys & set(self.keys))
        ]
        problems += [
            f"tenants: {name!r} is also a tenant made through the admin API; delete one"
            for name in sorted(set(config.tenants) & set(self.tenants))
        ]
        orphans: dict[str, list[str]] = {}
        for record in self.keys.values():
            if (
                record.revoked_at_unix_s is None
                and record.tenant not in config.tenants
                and record.tenant not in self.tenants
            ):
                orphans.setdefault(record.tenant, []).append(record.id)
        for tenant, ids in sorted(orphans.items()):
            problems.append(
                f"tenants: {tenant!r} is the tenant of API keys {', '.join(sorted(ids))}; keep it or revoke them"
            )
        return problems

    def tenant_exists(self, name: str, policy: Policy) -> bool:
        return name in policy.config.tenants or name in self.tenants

    # ------------------------------------------------------------------ applying stored documents
    def _apply_key(self, key_id: str, record: KeyRecord | None) -> None:
        old = self.keys.pop(key_id, None)
        if old is not None:
            for digest in (old.sha256, *(p.sha256 for p in old.previous)):
                entry = self._by_digest.get(digest)
                if entry is not None and entry.record.id == key_id:
                    del self._by_digest[digest]
        if record is None:
            return
        self.keys[key_id] = record
        if record.revoked_at_unix_s is not None:
            return
        self._by_digest[record.sha256] = _Entry(record, bytes.fromhex(record.sha256), None)
        for previous in record.previous:
            self._by_digest[previous.sha256] = _Entry(
                record, bytes.fromhex(previous.sha256), previous.valid_until_unix_s
            )

    def _apply_tenant(self, name: str, record: TenantRecord | None) -> None:
        if record is None:
            self.tenants.pop(name, None)
        else:
            self.tenants[name] = record
        for entry in self._by_digest.values():  # their principals carry the tenant's settings
            if entry.record.tenant == name:
                entry.policy = None

    def _apply_override(self, name: str, record: OverrideRecord | None) -> None:
        if record is None:
            self.overrides.pop(name, None)
        else:
            self.overrides[name] = record
        self.overrides_generation += 1

    def apply_doc(self, kind: Kind, name: str, doc: str | None) -> None:
        try:
            if kind == "key":
                self._apply_key(name, KeyRecord.model_validate_json(doc) if doc is not None else None)
            elif kind == "override":
                self._apply_override(name, OverrideRecord.model_validate_json(doc) if doc is not None else None)
            else:
                self._apply_tenant(name, TenantRecord.model_validate_json(doc) if doc is not None else None)
        except ValidationError as exc:
            log.error("unreadable %s %r in the key store, ignored: %s", kind, name, exc)

    def replace(self, snapshot: Snapshot) -> None:
        """Everything anew from a whole copy of the store (start-up, a reload)."""
        self.keys.clear()
        self.tenants.clear()
        self.overrides.clear()
        self.overrides_generation += 1
        self._by_digest.clear()
        for name, doc in snapshot.docs["tenant"].items():
            self.apply_doc("tenant", name, doc)
        for name, doc in snapshot.docs["key"].items():
            self.apply_doc("key", name, doc)
        for name, doc in snapshot.docs["override"].items():
            self.apply_doc("override", name, doc)
        self.version = self.seen_version = snapshot.version
        self.stats["reloads"] += 1
        self.changed()

    def changed(self) -> None:
        """Tells the listeners; a failing one is logged, never the writer's error."""
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("directory listener failed")


# Following a shared key store (Redis): other replicas' writes applied to this replica's index as
# they are announced, and a version poll that repairs a missed announcement with a full reload.
POLL_INTERVAL_S = 0.5  # version poll of a shared store: the repair path when an announcement is lost


async def follow(index: KeyIndex, store: DirectoryStore) -> None:
    """Apply other replicas' writes as announced; a gap in the versions means a reload."""
    while True:
        changes = store.changes()
        assert changes is not None
        try:
            async for change in changes:
                if change.version == 0:  # (re)subscribed: writes made meanwhile were not announced to us
                    index.replace(await store.load())
                    continue
                if change.version <= index.seen_version:
                    continue  # our own write, already applied, or replayed
                if change.version != index.seen_version + 1:
                    index.replace(await store.load())
                    continue
                index.apply_doc(change.kind, change.name, await store.fetch(change.kind, change.name))
                index.seen_version = change.version
                index.version = max(index.version, change.version)
                index.stats["applied"] += 1
                index.changed()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            index.stats["sync_errors"] += 1
            log.warning("key store subscription lost (%s); resubscribing", exc)
            await asyncio.sleep(POLL_INTERVAL_S)


async def poll(index: KeyIndex, store: DirectoryStore) -> None:
    """Reload when the store's version is ahead of what the announcements brought, twice in a
    row (once may be an announcement still in flight)."""
    behind = 0
    while True:
        await asyncio.sleep(POLL_INTERVAL_S)
        try:
            remote = await store.version()
            behind = behind + 1 if remote != index.seen_version else 0
            if behind >= 2:
                index.replace(await store.load())
                behind = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            index.stats["sync_errors"] += 1
            log.debug("key store version poll failed: %s", exc)
