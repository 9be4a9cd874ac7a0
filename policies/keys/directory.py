"""The directory of keys and tenants made through the admin API, held in memory for the hot path.

Authentication of such a key is one dictionary lookup by SHA-256 digest (after the file's keys),
a constant-time comparison, an expiry check and a cached principal: the store (SQLite, Redis) is
never touched per request. Writes go to the store first and then to the index, so what the API
acknowledged survives a restart; with Redis every replica applies every write as its
announcement arrives (`sync`), and a version poll repairs a missed one with a full reload.

Principals are compiled against the running policy (a file tenant's models and priority, alias
resolution) on first use after a change or a policy reload, and cached on the entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from policies.keys.records import (
    MAX_PREVIOUS_SECRETS,
    KeyCreate,
    KeyPatch,
    KeyRecord,
    PreviousSecret,
    Rotate,
    TenantCreate,
    TenantPatch,
    TenantRecord,
    merged_limits,
    parse_expiry,
)
from policies.keys.store import DirectoryStore, Kind, Snapshot
from policies.schema import PRIORITY_VALUES, PoliciesConfig, TenantConfig
from policies.types import Principal

if TYPE_CHECKING:
    from policies.policy import Policy

log = logging.getLogger(__name__)

SECRET_PREFIX = "tw-"
POLL_INTERVAL_S = 0.5  # version poll of a shared store: the repair path when an announcement is lost
FLUSH_INTERVAL_S = 10.0  # last-use times are written this often


class DirectoryError(Exception):
    """A change the directory refuses: HTTP status, message and the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(slots=True)
class _Entry:
    record: KeyRecord
    digest: bytes
    valid_until_s: float | None  # a rotated-out secret's grace deadline; None for the current one
    policy: Policy | None = None  # the policy `principal` was compiled against
    principal: Principal | None = None


class KeyDirectory:
    def __init__(self, store: DirectoryStore, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock
        self.keys: dict[str, KeyRecord] = {}
        self.tenants: dict[str, TenantRecord] = {}
        self._by_digest: dict[str, _Entry] = {}
        self._used: dict[str, float] = {}  # key id -> last use not yet written to the store
        self.last_used: dict[str, float] = {}
        self.version = 0
        self._seen_version = 0  # the last announcement applied in order (shared stores)
        self._compiles = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[Callable[[], None]] = []
        self.stats = {"reloads": 0, "applied": 0, "sync_errors": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load everything, then follow the store (other replicas' writes) and save last-use times."""
        self._replace(await self.store.load())
        self.last_used = await self.store.last_used()
        loop = asyncio.get_running_loop()
        if self.store.changes() is not None:
            self._tasks.append(loop.create_task(self._follow()))
            self._tasks.append(loop.create_task(self._poll()))
        self._tasks.append(loop.create_task(self._flush_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self.flush()
        await self.store.close()

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
        allowed: set[str] | None = None
        if tenant.models is not None:
            allowed = {config.canonical_model(m) or m for m in tenant.models}
        if record.models is not None:
            narrowed = {config.canonical_model(m) or m for m in record.models}
            allowed = narrowed if allowed is None else allowed & narrowed
        self._compiles += 1
        return Principal(
            key_id=record.id,
            tenant=record.tenant,
            allowed_models=frozenset(allowed) if allowed is not None else None,
            priority=PRIORITY_VALUES[record.priority or tenant.priority],
            allow_fallback=tenant.allow_fallback,
            key_limits=record.limits.own(),
            tenant_limits=api_tenant.limits.own() if api_tenant is not None else None,
            revision=self._compiles,
            track_spend=True,
            slo_class=api_tenant.slo_class if api_tenant is not None else None,
            source="api",
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

    # ------------------------------------------------------------------ keys
    async def create_key(
        self, payload: dict[str, Any], policy: Policy, known_models: Iterable[str]
    ) -> tuple[KeyRecord, str]:
        """A new key and its secret (shown once; only the digest is kept)."""
        spec = _validated(KeyCreate, payload)
        if not self.tenant_exists(spec.tenant, policy):
            raise DirectoryError(404, f"no tenant {spec.tenant!r}: create it first (POST /admin/tenants)", "tenant")
        key_id = spec.id or f"{spec.tenant}-{secrets.token_hex(3)}"
        if key_id in self.keys or _file_key(policy, key_id):
            raise DirectoryError(409, f"a key with id {key_id!r} already exists", "id")
        _check_models(spec.models, policy, known_models, "models")
        now_s = self._clock()
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(
            id=key_id,
            tenant=spec.tenant,
            sha256=_digest(secret),
            hint=f"{secret[:6]}...{secret[-4:]}",
            models=spec.models,
            priority=spec.priority,
            limits=spec.limits,
            expires_at_unix_s=_expiry(spec.expires_at, spec.expires_in, now_s),
            metadata=spec.metadata,
            created_at_unix_s=now_s,
            updated_at_unix_s=now_s,
        )
        await self._write_key(record)
        return record, secret

    async def patch_key(
        self, key_id: str, payload: dict[str, Any], policy: Policy, known_models: Iterable[str]
    ) -> KeyRecord:
        record = self._live_key(key_id)
        patch = _validated(KeyPatch, payload)
        changes: dict[str, Any] = {}
        given = patch.model_fields_set
        if "models" in given:
            _check_models(patch.models, policy, known_models, "models")
            changes["models"] = patch.models
        if "priority" in given:
            changes["priority"] = patch.priority
        if "limits" in given:
            changes["limits"] = _merge(record.limits, patch.limits or {})
        if "expires_at" in given or "expires_in" in given:
            changes["expires_at_unix_s"] = _expiry(patch.expires_at, patch.expires_in, self._clock())
        if "metadata" in given:
            changes["metadata"] = patch.metadata or record.metadata.model_copy(update={})
        updated = record.model_copy(
            update={**changes, "updated_at_unix_s": self._clock(), "revision": record.revision + 1}
        )
        await self._write_key(updated)
        return updated

    async def revoke_key(self, key_id: str) -> KeyRecord:
        record = self._live_key(key_id)
        now_s = self._clock()
        revoked = record.model_copy(
            update={
                "revoked_at_unix_s": now_s,
                "updated_at_unix_s": now_s,
                "previous": [],
                "revision": record.revision + 1,
            }
        )
        await self._write_key(revoked)
        return revoked

    async def rotate_key(self, key_id: str, payload: dict[str, Any]) -> tuple[KeyRecord, str]:
        """A new secret; the current one stays valid for `grace_s` (0: revoked at once)."""
        record = self._live_key(key_id)
        rotate = _validated(Rotate, payload)
        now_s = self._clock()
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        previous = [p for p in record.previous if p.valid_until_unix_s > now_s]
        if rotate.grace_s > 0:
            previous.append(PreviousSecret(sha256=record.sha256, valid_until_unix_s=now_s + rotate.grace_s))
        rotated = record.model_copy(
            update={
                "sha256": _digest(secret),
                "hint": f"{secret[:6]}...{secret[-4:]}",
                "previous": previous[-MAX_PREVIOUS_SECRETS:],
                "updated_at_unix_s": now_s,
                "revision": record.revision + 1,
            }
        )
        await self._write_key(rotated)
        return rotated, secret

    def _live_key(self, key_id: str) -> KeyRecord:
        record = self.keys.get(key_id)
        if record is None:
            raise DirectoryError(404, f"no key {key_id!r} made through the admin API", "id")
        if record.revoked_at_unix_s is not None:
            raise DirectoryError(409, f"key {key_id!r} is revoked", "id")
        return record

    async def _write_key(self, record: KeyRecord) -> None:
        version = await self._store_write("key", record.id, record.model_dump_json())
        self._apply_key(record.id, record)
        self.version = max(self.version, version)
        self._changed()

    # ------------------------------------------------------------------ tenants
    def tenant_exists(self, name: str, policy: Policy) -> bool:
        return name in policy.config.tenants or name in self.tenants

    async def create_tenant(self, payload: dict[str, Any], policy: Policy, known_models: Iterable[str]) -> TenantRecord:
        spec = _validated(TenantCreate, payload)
        if self.tenant_exists(spec.name, policy):
            raise DirectoryError(409, f"a tenant named {spec.name!r} already exists", "name")
        _check_models(spec.models, policy, known_models, "models")
        _check_slo_class(spec.slo_class, policy)
        now_s = self._clock()
        record = TenantRecord(**spec.model_dump(), created_at_unix_s=now_s, updated_at_unix_s=now_s)
        await self._write_tenant(record)
        return record

    async def patch_tenant(
        self, name: str, payload: dict[str, Any], policy: Policy, known_models: Iterable[str]
    ) -> TenantRecord:
        record = self.tenants.get(name)
        if record is None:
            raise DirectoryError(404, f"no tenant {name!r} made through the admin API", "name")
        patch = _validated(TenantPatch, payload)
        given = patch.model_fields_set
        changes: dict[str, Any] = {}
        for field in ("priority", "allow_fallback", "slo_class", "models"):
            if field in given:
                changes[field] = getattr(patch, field)
        if "models" in given:
            _check_models(patch.models, policy, known_models, "models")
        if "slo_class" in given:
            _check_slo_class(patch.slo_class, policy)
        if "limits" in given:
            changes["limits"] = _merge(record.limits, patch.limits or {})
        if "metadata" in given and patch.metadata is not None:
            changes["metadata"] = patch.metadata
        updated = record.model_copy(
            update={**changes, "updated_at_unix_s": self._clock(), "revision": record.revision + 1}
        )
        await self._write_tenant(updated)
        return updated

    async def delete_tenant(self, name: str) -> None:
        if name not in self.tenants:
            raise DirectoryError(404, f"no tenant {name!r} made through the admin API", "name")
        users = sorted(r.id for r in self.keys.values() if r.tenant == name and r.revoked_at_unix_s is None)
        if users:
            raise DirectoryError(409, f"tenant {name!r} still has keys: {', '.join(users)}; revoke them first", "name")
        version = await self._store_write("tenant", name, None)
        self._apply_tenant(name, None)
        self.version = max(self.version, version)
        self._changed()

    async def _write_tenant(self, record: TenantRecord) -> None:
        version = await self._store_write("tenant", record.name, record.model_dump_json())
        self._apply_tenant(record.name, record)
        self.version = max(self.version, version)
        self._changed()

    async def _store_write(self, kind: Kind, name: str, doc: str | None) -> int:
        try:
            return await self.store.write(kind, name, doc)
        except DirectoryError:
            raise
        except Exception as exc:  # the change is refused as a whole: nothing was applied
            log.warning("key store write failed: %s", exc)
            raise DirectoryError(503, f"the key store ({self.store.name}) is unavailable: {exc}") from exc

    # ------------------------------------------------------------------ the index
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

    def _apply_doc(self, kind: Kind, name: str, doc: str | None) -> None:
        try:
            if kind == "key":
                self._apply_key(name, KeyRecord.model_validate_json(doc) if doc is not None else None)
            else:
                self._apply_tenant(name, TenantRecord.model_validate_json(doc) if doc is not None else None)
        except ValidationError as exc:
            log.error("unreadable %s %r in the key store, ignored: %s", kind, name, exc)

    def _replace(self, snapshot: Snapshot) -> None:
        self.keys.clear()
        self.tenants.clear()
        self._by_digest.clear()
        for name, doc in snapshot.docs["tenant"].items():
            self._apply_doc("tenant", name, doc)
        for name, doc in snapshot.docs["key"].items():
            self._apply_doc("key", name, doc)
        self.version = self._seen_version = snapshot.version
        self.stats["reloads"] += 1
        self._changed()

    def _changed(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("directory listener failed")

    # ------------------------------------------------------------------ following a shared store
    async def _follow(self) -> None:
        """Apply other replicas' writes as announced; a gap in the versions means a reload."""
        while True:
            changes = self.store.changes()
            assert changes is not None
            try:
                async for change in changes:
                    if change.version == 0:  # (re)subscribed: writes made meanwhile were not announced to us
                        await self.reload()
                        continue
                    if change.version <= self._seen_version:
                        continue  # our own write, already applied, or replayed
                    if change.version != self._seen_version + 1:
                        await self.reload()
                        continue
                    self._apply_doc(change.kind, change.name, await self.store.fetch(change.kind, change.name))
                    self._seen_version = change.version
                    self.version = max(self.version, change.version)
                    self.stats["applied"] += 1
                    self._changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["sync_errors"] += 1
                log.warning("key store subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll(self) -> None:
        """Reload when the store's version is ahead of what the announcements brought, twice in a
        row (once may be an announcement still in flight)."""
        behind = 0
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                remote = await self.store.version()
                behind = behind + 1 if remote != self._seen_version else 0
                if behind >= 2:
                    await self.reload()
                    behind = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["sync_errors"] += 1
                log.debug("key store version poll failed: %s", exc)

    async def reload(self) -> None:
        self._replace(await self.store.load())

    # ------------------------------------------------------------------ last use
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("saving keys' last use failed: %s", exc)

    async def flush(self) -> None:
        """Write last-use times gathered since the previous flush (they are kept on failure)."""
        if not self._used:
            return
        pending, self._used = self._used, {}
        try:
            await self.store.touch(pending)
        except Exception:
            for key_id, at_s in pending.items():
                self._used[key_id] = max(at_s, self._used.get(key_id, 0.0))
            raise
        for key_id, at_s in pending.items():
            self.last_used[key_id] = max(at_s, self.last_used.get(key_id, 0.0))

    def last_use_of(self, key_id: str) -> float | None:
        pending = self._used.get(key_id)
        stored = self.last_used.get(key_id)
        return max(v for v in (pending, stored) if v is not None) if pending or stored else None

    def status(self) -> dict[str, Any]:
        active = sum(1 for r in self.keys.values() if r.revoked_at_unix_s is None)
        return {
            "store": self.store.name,
            "version": self.version,
            "keys": len(self.keys),
            "active_keys": active,
            "tenants": len(self.tenants),
            **self.stats,
        }


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _file_key(policy: Policy, key_id: str) -> bool:
    return any(k.id == key_id for k in policy.config.keys)


def _validated(model: Any, payload: dict[str, Any]) -> Any:
    if not isinstance(payload, dict):
        raise DirectoryError(400, "expected a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field (expected one of: {', '.join(model.model_fields)})"
        raise DirectoryError(400, f"{param}: {message}" if param else message, param) from None


def _merge(current: Any, changes: dict[str, Any]) -> Any:
    try:
        return merged_limits(current, changes)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = "limits." + ".".join(str(p) for p in error["loc"])
        raise DirectoryError(400, f"{param}: {error['msg']}", param) from None
    except ValueError as exc:
        raise DirectoryError(400, f"limits: {exc}", "limits") from None


def _expiry(expires_at: str | float | None, expires_in: str | None, now_s: float) -> float | None:
    try:
        found = parse_expiry(expires_at, expires_in, now_s)
    except ValueError as exc:
        raise DirectoryError(400, str(exc), "expires_at") from None
    if found is not None and found <= now_s:
        raise DirectoryError(400, "expires_at: must be in the future", "expires_at")
    return found


def _check_models(models: list[str] | None, policy: Policy, known: Iterable[str], param: str) -> None:
    if models is None:
        return
    config = policy.config
    names = set(known) | set(config.models) | {a for m in config.models.values() for a in m.aliases}
    unknown = [m for m in models if m not in names]
    if unknown:
        raise DirectoryError(400, f"{param}: unknown model {', '.join(map(repr, unknown))}", param)


def _check_slo_class(name: str | None, policy: Policy) -> None:
    if name is not None and name not in policy.config.slo_classes:
        known = ", ".join(sorted(policy.config.slo_classes)) or "none defined"
        raise DirectoryError(400, f"slo_class: unknown slo class {name!r} ({known})", "slo_class")
