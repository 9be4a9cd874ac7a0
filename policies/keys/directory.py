"""The directory of keys and tenants made through the admin API: their changes, checked, stored and
applied, over the in-memory index the hot path reads (`policies/keys/index.py`).

Writes go to the store (SQLite, Redis) first and then to the index, so what the API acknowledged
survives a restart; with Redis every replica applies every write as its announcement arrives, and a
version poll repairs a missed one with a full reload (`policies/keys/index.py`: `follow`, `poll`). Keys' last-use
times are gathered in memory and written every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from backends.tasks import cancel_and_wait
from policies.keys.index import KeyIndex, follow, poll
from policies.keys.records import (
    MAX_OVERRIDE_S,
    MAX_PREVIOUS_SECRETS,
    KeyCreate,
    KeyPatch,
    KeyRecord,
    OverrideCreate,
    OverrideRecord,
    PreviousSecret,
    Rotate,
    TenantCreate,
    TenantPatch,
    TenantRecord,
    merged_limits,
    parse_expiry,
)
from policies.keys.store import DirectoryStore, Kind

if TYPE_CHECKING:
    from policies.policy import Policy

log = logging.getLogger(__name__)

SECRET_PREFIX = "tw-"
FLUSH_INTERVAL_S = 10.0  # last-use times are written this often
MAX_OVERRIDES = 1000  # live temporary overrides at once


class DirectoryError(Exception):
    """A change the directory refuses: HTTP status, message and the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class KeyDirectory(KeyIndex):
    def __init__(self, store: DirectoryStore, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock=clock)
        self.store = store
        self.last_used: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load everything, then follow the store (other replicas' writes) and save last-use times."""
        self.replace(await self.store.load())
        self.last_used = await self.store.last_used()
        loop = asyncio.get_running_loop()
        if self.store.changes() is not None:
            self._tasks.append(loop.create_task(follow(self, self.store)))
            self._tasks.append(loop.create_task(poll(self, self.store)))
        self._tasks.append(loop.create_task(self._flush_loop()))

    async def stop(self) -> None:
        """Cancel the background tasks, again while one is still running: a cancellation that
        lands while redis-py reads under its own timeout can be swallowed (asyncio.timeout on
        Python 3.11), and the subscriber would then listen on, holding shutdown forever."""
        await cancel_and_wait(self._tasks, what="key directory")
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self.flush()
        await self.store.close()

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
        self.changed()

    # ------------------------------------------------------------------ tenants
    async def create_tenant(self, payload: dict[str, Any], policy: Policy, known_models: Iterable[str]) -> TenantRecord:
        spec = _validated(TenantCreate, payload)
        if self.tenant_exists(spec.name, policy):
            raise DirectoryError(409, f"a tenant named {spec.name!r} already exists", "name")
        _check_models(spec.models, policy, known_models, "models")
        _check_slo_class(spec.slo_class, policy)
        _check_team(spec.team, policy)
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
        for field in ("priority", "allow_fallback", "slo_class", "models", "team"):
            if field in given:
                changes[field] = getattr(patch, field)
        if "models" in given:
            _check_models(patch.models, policy, known_models, "models")
        if "slo_class" in given:
            _check_slo_class(patch.slo_class, policy)
        if "team" in given:
            _check_team(patch.team, policy)
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
        self.changed()

    async def _write_tenant(self, record: TenantRecord) -> None:
        version = await self._store_write("tenant", record.name, record.model_dump_json())
        self._apply_tenant(record.name, record)
        self.version = max(self.version, version)
        self.changed()

    # ------------------------------------------------------------------ temporary overrides
    async def create_override(self, payload: dict[str, Any], policy: Policy) -> OverrideRecord:
        """A rule's limit raised (or lowered) until a time; expired overrides are dropped first, so
        the live ones stay under `MAX_OVERRIDES` whatever the API is sent."""
        spec = _validated(OverrideCreate, payload)
        rule = _override_rule(policy, spec.rule, spec.dimension)
        now_s = self._clock()
        if spec.until is None and spec.for_ is None:
            raise DirectoryError(400, "until or for: an override ends by itself (e.g. for: 2h)", "until")
        param = "for" if spec.for_ is not None else "until"
        try:
            until = parse_expiry(spec.until, spec.for_, now_s)
        except ValueError as exc:
            raise DirectoryError(
                400, str(exc).replace("expires_in", "for").replace("expires_at", "until"), param
            ) from None
        if until is None or until <= now_s:
            raise DirectoryError(400, f"{param}: must be in the future", param)
        if until - now_s > MAX_OVERRIDE_S:
            raise DirectoryError(400, f"{param}: at most a year ahead; change policies.yaml instead", param)
        for name in [n for n, o in self.overrides.items() if o.until_unix_s <= now_s]:
            await self._write_override(name, None)
        if len(self.overrides) >= MAX_OVERRIDES:
            raise DirectoryError(409, f"{MAX_OVERRIDES} overrides are active; delete one first", "rule")
        record = OverrideRecord(
            id=f"ov-{secrets.token_hex(4)}",
            rule=rule,
            subject=spec.subject,
            dimension=spec.dimension,
            value=spec.value,
            until_unix_s=until,
            reason=spec.reason,
            created_at_unix_s=now_s,
        )
        await self._write_override(record.id, record)
        return record

    async def delete_override(self, override_id: str) -> OverrideRecord:
        found = self.overrides.get(override_id)
        if found is None:
            raise DirectoryError(404, f"no override {override_id!r}", "id")
        await self._write_override(override_id, None)
        return found

    async def _write_override(self, name: str, record: OverrideRecord | None) -> None:
        version = await self._store_write("override", name, record.model_dump_json() if record is not None else None)
        self._apply_override(name, record)
        self.version = max(self.version, version)
        self.changed()

    async def _store_write(self, kind: Kind, name: str, doc: str | None) -> int:
        try:
            return await self.store.write(kind, name, doc)
        except DirectoryError:
            raise
        except Exception as exc:  # the change is refused as a whole: nothing was applied
            log.warning("key store write failed: %s", exc)
            raise DirectoryError(503, f"the key store ({self.store.name}) is unavailable: {exc}") from exc

    async def reload(self) -> None:
        self.replace(await self.store.load())

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
        param = ".".join(str(p) for p in error["loc"] if not _UNION_TAG.match(str(p))) or None
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field (expected one of: {', '.join(model.model_fields)})"
        raise DirectoryError(400, f"{param}: {message}" if param else message, param) from None


_UNION_TAG = re.compile(r"^(constrained-)?(str|float|int|bool|none)$|\[")  # pydantic's union members in `loc`


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
    param = "expires_in" if expires_in is not None else "expires_at"
    try:
        found = parse_expiry(expires_at, expires_in, now_s)
    except ValueError as exc:
        raise DirectoryError(400, str(exc), param) from None
    if found is not None and found <= now_s:
        raise DirectoryError(400, f"{param}: must be in the future", param)
    return found


def _check_models(models: list[str] | None, policy: Policy, known: Iterable[str], param: str) -> None:
    if models is None:
        return
    config = policy.config
    names = set(known) | set(config.models) | {a for m in config.models.values() for a in m.aliases}
    unknown = [m for m in models if m not in names]
    if unknown:
        raise DirectoryError(400, f"{param}: unknown model {', '.join(map(repr, unknown))}", param)


def _override_rule(policy: Policy, rule: str, dimension: str) -> str:
    """The identity of the policies.yaml rule an override names, which must set `dimension`."""
    config = policy.config
    for found in [*config.limits, *config.budgets]:
        if found.identity(config.resolve_model) == rule:
            if getattr(found, dimension, None) is None:
                raise DirectoryError(400, f"rule {rule!r} does not set {dimension}", "dimension")
            return rule
    known = sorted({r.identity(config.resolve_model) for r in [*config.limits, *config.budgets]})
    raise DirectoryError(404, f"no rule {rule!r} in policies.yaml (rules: {', '.join(known) or 'none'})", "rule")


def _check_team(name: str | None, policy: Policy) -> None:
    if name is not None and name not in policy.config.teams:
        known = ", ".join(sorted(policy.config.teams)) or "none defined"
        raise DirectoryError(400, f"team: unknown team {name!r} ({known})", "team")


def _check_slo_class(name: str | None, policy: Policy) -> None:
    if name is not None and name not in policy.config.slo_classes:
        known = ", ".join(sorted(policy.config.slo_classes)) or "none defined"
        raise DirectoryError(400, f"slo_class: unknown slo class {name!r} ({known})", "slo_class")
