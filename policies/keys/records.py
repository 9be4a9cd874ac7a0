"""Keys and tenants made through the admin API: what is stored, and the payloads that change it.

A key is stored as the SHA-256 of its secret (never the secret), with its tenant, allowed models,
own limits and budgets, expiry and metadata. Rotation keeps the previous digest valid until a grace
deadline; revocation keeps the record (for the audit trail and the console) with `revoked_at`.
`revision` counts the record's changes. Records are pydantic models because they are
configuration, validated when written through the API or read back from the store, never per
request: the request path only sees the principals compiled from them (`directory.py`).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.schema import PriorityName
from policies.times import parse_duration_s, parse_iso_s
from policies.types import OwnLimits

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
MAX_PREVIOUS_SECRETS = 4  # rotations still in their grace period at once
MAX_METADATA_CHARS = 1000
DEFAULT_GRACE_S = 3600.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """A key's or tenant's own limits; each overrides the file's rules of that scope and dimension."""

    rpm: int | None = Field(default=None, ge=1, description="requests per minute")
    rpd: int | None = Field(default=None, ge=1, description="requests per day")
    tpm: int | None = Field(default=None, ge=1, description="tokens per minute")
    tpd: int | None = Field(default=None, ge=1, description="tokens per day")
    max_concurrent: int | None = Field(default=None, ge=1, description="requests in flight")
    usd_per_day: float | None = Field(default=None, gt=0, description="budget, resets 00:00 UTC")
    usd_per_month: float | None = Field(default=None, gt=0, description="budget, resets on the 1st, 00:00 UTC")

    def own(self) -> OwnLimits | None:
        values = self.model_dump()
        return OwnLimits(**values) if any(v is not None for v in values.values()) else None


class Metadata(_Strict):
    owner: str | None = Field(default=None, max_length=200)
    team: str | None = Field(default=None, max_length=200)
    description: str | None = Field(default=None, max_length=MAX_METADATA_CHARS)


class PreviousSecret(_Strict):
    sha256: str
    valid_until_unix_s: float


class KeyRecord(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    tenant: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    hint: str = Field(default="", description="the secret's first and last characters, to recognise it")
    previous: list[PreviousSecret] = Field(default_factory=list, description="rotated-out secrets in grace")
    models: list[str] | None = None
    priority: PriorityName | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    expires_at_unix_s: float | None = None
    metadata: Metadata = Field(default_factory=Metadata)
    created_at_unix_s: float
    updated_at_unix_s: float
    revoked_at_unix_s: float | None = None
    revision: int = 1

    def status(self, now_s: float) -> str:
        if self.revoked_at_unix_s is not None:
            return "revoked"
        if self.expires_at_unix_s is not None and now_s >= self.expires_at_unix_s:
            return "expired"
        return "active"

    def view(self, now_s: float, last_used_unix_s: float | None = None) -> dict[str, Any]:
        """What the API shows: everything but digests (a secret is shown once, at creation)."""
        return {
            "id": self.id,
            "source": "api",
            "tenant": self.tenant,
            "status": self.status(now_s),
            "hint": self.hint,
            "models": self.models,
            "priority": self.priority,
            "limits": self.limits.model_dump(exclude_none=True),
            "expires_at": _iso(self.expires_at_unix_s),
            "metadata": self.metadata.model_dump(exclude_none=True),
            "created_at": _iso(self.created_at_unix_s),
            "updated_at": _iso(self.updated_at_unix_s),
            "revoked_at": _iso(self.revoked_at_unix_s),
            "last_used_at": _iso(last_used_unix_s),
            "previous_secrets_valid_until": [
                _iso(p.valid_until_unix_s) for p in self.previous if p.valid_until_unix_s > now_s
            ],
            "revision": self.revision,
        }


class _TenantSettings(_Strict):
    """A tenant's settings: what it is made with and what its record keeps."""

    name: str = Field(pattern=ID_PATTERN)
    models: list[str] | None = None
    priority: PriorityName = "normal"
    allow_fallback: bool = True
    slo_class: str | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metadata: Metadata = Field(default_factory=Metadata)


class TenantRecord(_TenantSettings):
    created_at_unix_s: float
    updated_at_unix_s: float
    revision: int = 1

    def view(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": "api",
            "models": self.models,
            "priority": self.priority,
            "allow_fallback": self.allow_fallback,
            "slo_class": self.slo_class,
            "limits": self.limits.model_dump(exclude_none=True),
            "metadata": self.metadata.model_dump(exclude_none=True),
            "created_at": _iso(self.created_at_unix_s),
            "updated_at": _iso(self.updated_at_unix_s),
            "revision": self.revision,
        }


# ---------------------------------------------------------------------- payloads of the admin API
class KeyCreate(_Strict):
    id: str | None = Field(default=None, pattern=ID_PATTERN, description="default: <tenant>-<6 hex>")
    tenant: str
    models: list[str] | None = None
    priority: PriorityName | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    expires_at: str | float | None = Field(default=None, description="ISO-8601 time or unix seconds")
    expires_in: str | None = Field(default=None, description="a duration from now: 30d, 12h, 90m")
    metadata: Metadata = Field(default_factory=Metadata)


class KeyPatch(_Strict):
    """Fields given replace the stored ones (null clears); `limits` merges per field."""

    models: list[str] | None = None
    priority: PriorityName | None = None
    limits: dict[str, float | int | None] | None = None
    expires_at: str | float | None = None
    expires_in: str | None = None
    metadata: Metadata | None = None


class Rotate(_Strict):
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0, le=30 * 86400, description="old secret stays valid")


class TenantCreate(_TenantSettings):
    """The body of POST /admin/tenants: a record's settings, without its times and revision."""


class TenantPatch(_Strict):
    models: list[str] | None = None
    priority: PriorityName | None = None
    allow_fallback: bool | None = None
    slo_class: str | None = None
    limits: dict[str, float | int | None] | None = None
    metadata: Metadata | None = None

    @field_validator("priority", "allow_fallback")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("cannot be null")
        return value


def merged_limits(current: LimitsConfig, changes: dict[str, float | int | None]) -> LimitsConfig:
    """`current` with each given field replaced (None removes it); raises ValueError on bad ones."""
    unknown = sorted(set(changes) - set(LimitsConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown limit {', '.join(unknown)} (expected one of {', '.join(LimitsConfig.model_fields)})")
    return LimitsConfig.model_validate({**current.model_dump(), **changes})


def parse_expiry(expires_at: str | float | None, expires_in: str | None, now_s: float | None = None) -> float | None:
    """Unix seconds from an ISO time, unix seconds, or a duration from now (`30d`); ValueError if bad."""
    now_s = time.time() if now_s is None else now_s
    if expires_in is not None:
        try:
            return now_s + parse_duration_s(expires_in)
        except ValueError:
            raise ValueError(f"expires_in: not a duration: {expires_in!r} (e.g. 30d, 12h, 90m)") from None
    if expires_at is None:
        return None
    if isinstance(expires_at, int | float):
        return float(expires_at)
    try:
        return parse_iso_s(expires_at)
    except ValueError:
        raise ValueError(f"expires_at: not an ISO-8601 time: {expires_at!r}") from None


def _iso(unix_s: float | None) -> str | None:
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
