"""Keys and tenants made through the admin API: what is stored, and the payloads that change it.

A key is stored as the SHA-256 of its secret (never the secret), with its tenant, allowed models,
own limits and budgets, expiry and metadata. Rotation keeps the previous digest valid until a grace
deadline; revocation keeps the record (for the audit trail and the console) with `revoked_at`.
`revision` counts the record's changes. Records are pydantic models because they are
configuration, validated when written through the API or read back from the store, never per
request: the request path only sees the principals compiled from them (`directory.py`).
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.schema import PriorityName
from policies.types import OwnLimits, parse_duration_s, parse_iso_s

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
MAX_PREVIOUS_SECRETS = 4  # rotations still in their grace period at once
MAX_METADATA_CHARS = 1000
DEFAULT_GRACE_S = 3600.0
# Bounds of what the admin API accepts, so that every stored record can be rendered and compared:
# a limit or budget beyond these is a typo (or a probe), not a policy.
MAX_LIMIT = 10**12
MAX_USD = 1e12
MAX_EXPIRY_UNIX_S = 253_402_300_799.0  # 9999-12-31T23:59:59Z: the last second an ISO time can name
MAX_MODELS = 256
MAX_NAME_CHARS = 200

ModelName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)]
Usd = Annotated[float, Field(gt=0, le=MAX_USD)]


class _Strict(BaseModel):
    """Unknown fields, NaN and infinities are refused everywhere (a JSON body cannot carry the
    latter two, but a stored document or a Python caller could)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LimitsConfig(_Strict):
    """A key's or tenant's own limits; each overrides the file's rules of that scope and dimension."""

    rpm: Limit | None = Field(default=None, description="requests per minute")
    rpd: Limit | None = Field(default=None, description="requests per day")
    tpm: Limit | None = Field(default=None, description="tokens per minute")
    tpd: Limit | None = Field(default=None, description="tokens per day")
    max_concurrent: Limit | None = Field(default=None, description="requests in flight")
    usd_per_day: Usd | None = Field(default=None, description="budget, resets 00:00 UTC")
    usd_per_month: Usd | None = Field(default=None, description="budget, resets on the 1st, 00:00 UTC")

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
    models: list[ModelName] | None = Field(default=None, max_length=MAX_MODELS)
    priority: PriorityName = "normal"
    allow_fallback: bool = True
    slo_class: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    team: str | None = Field(default=None, max_length=MAX_NAME_CHARS, description="a team of policies.yaml")
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
            "team": self.team,
            "limits": self.limits.model_dump(exclude_none=True),
            "metadata": self.metadata.model_dump(exclude_none=True),
            "created_at": _iso(self.created_at_unix_s),
            "updated_at": _iso(self.updated_at_unix_s),
            "revision": self.revision,
        }


# ---------------------------------------------------------------------- payloads of the admin API
def _no_bool(value: Any) -> Any:
    """JSON `true` is not a time (pydantic would read it as 1.0)."""
    if isinstance(value, bool):
        raise ValueError("expected an ISO-8601 time or unix seconds, not a boolean")
    return value


class KeyCreate(_Strict):
    id: str | None = Field(default=None, pattern=ID_PATTERN, description="default: <tenant>-<6 hex>")
    tenant: str = Field(pattern=ID_PATTERN)
    models: list[ModelName] | None = Field(default=None, max_length=MAX_MODELS)
    priority: PriorityName | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    expires_at: Annotated[str, Field(max_length=64)] | float | None = Field(
        default=None, description="ISO-8601 time or unix seconds"
    )
    expires_in: str | None = Field(default=None, max_length=32, description="a duration from now: 30d, 12h, 90m")
    metadata: Metadata = Field(default_factory=Metadata)

    _times = field_validator("expires_at", mode="before")(_no_bool)


class KeyPatch(_Strict):
    """Fields given replace the stored ones (null clears); `limits` merges per field."""

    models: list[ModelName] | None = Field(default=None, max_length=MAX_MODELS)
    priority: PriorityName | None = None
    limits: dict[Annotated[str, Field(max_length=64)], float | int | None] | None = Field(default=None, max_length=16)
    expires_at: Annotated[str, Field(max_length=64)] | float | None = None
    expires_in: str | None = Field(default=None, max_length=32)
    metadata: Metadata | None = None

    _times = field_validator("expires_at", mode="before")(_no_bool)


class Rotate(_Strict):
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0, le=30 * 86400, description="old secret stays valid")


class TenantCreate(_TenantSettings):
    """The body of POST /admin/tenants: a record's settings, without its times and revision."""


class TenantPatch(_Strict):
    models: list[ModelName] | None = Field(default=None, max_length=MAX_MODELS)
    priority: PriorityName | None = None
    allow_fallback: bool | None = None
    slo_class: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    team: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    limits: dict[Annotated[str, Field(max_length=64)], float | int | None] | None = Field(default=None, max_length=16)
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
    """Unix seconds from an ISO time, unix seconds, or a duration from now (`30d`); ValueError if bad,
    or beyond what a record can hold (not finite, after 9999-12-31)."""
    now_s = time.time() if now_s is None else now_s
    if expires_in is not None:
        try:
            found = now_s + parse_duration_s(expires_in)
        except ValueError:
            raise ValueError(f"expires_in: not a duration: {expires_in!r} (e.g. 30d, 12h, 90m)") from None
        if not math.isfinite(found) or found > MAX_EXPIRY_UNIX_S:
            raise ValueError("expires_in: too far in the future (at most until 9999-12-31)")
        return found
    if expires_at is None:
        return None
    if isinstance(expires_at, int | float):
        found = float(expires_at)
    else:
        try:
            found = parse_iso_s(expires_at)
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"expires_at: not an ISO-8601 time: {expires_at!r}") from None
    if not math.isfinite(found) or found > MAX_EXPIRY_UNIX_S:
        raise ValueError("expires_at: too far in the future (at most 9999-12-31T23:59:59Z)")
    return found


def _iso(unix_s: float | None) -> str | None:
    """ISO-8601 UTC; raises ValueError/OverflowError/OSError for a time no calendar holds (a record
    stored before these bounds existed: the listings show it flagged rather than fail)."""
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------- temporary overrides
OverrideDimension = Literal[
    "rpm",
    "rpd",
    "tpm",
    "tpd",
    "max_concurrent",
    "calls_per_run",
    "tokens_per_run",
    "seconds_per_run",
    "usd_per_day",
    "usd_per_month",
    "usd_per_period",
    "usd_per_run",
]
MAX_OVERRIDE_S = 366 * 86_400.0  # an override longer than a year is a policy change: edit policies.yaml


class OverrideCreate(_Strict):
    """The body of POST /admin/overrides: one rule's limit set to `value` for one subject (or every
    subject of the rule) until a time, then back to the rule's own value by itself."""

    rule: str = Field(
        min_length=1, max_length=MAX_NAME_CHARS, description="a rule's identity (its id, or scope[match])"
    )
    subject: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS, description="null: every one")
    dimension: OverrideDimension
    value: float = Field(gt=0, le=MAX_USD)
    until: str | float | None = Field(default=None, description="ISO time or unix seconds")
    for_: str | None = Field(default=None, alias="for", description="a duration from now: 2h, 3d")
    reason: str | None = Field(default=None, max_length=MAX_METADATA_CHARS)

    @field_validator("until", mode="before")
    @classmethod
    def _until_is_a_time(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("expected an ISO-8601 time or unix seconds, not a boolean")
        return value


class OverrideRecord(_Strict):
    id: str = Field(pattern=ID_PATTERN)
    rule: str
    subject: str | None = None
    dimension: OverrideDimension
    value: float
    until_unix_s: float
    reason: str | None = None
    created_at_unix_s: float

    def view(self, now_s: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "rule": self.rule,
            "subject": self.subject,
            "dimension": self.dimension,
            "value": self.value,
            "until": _iso(self.until_unix_s),
            "active": now_s < self.until_unix_s,
            "reason": self.reason,
            "created_at": _iso(self.created_at_unix_s),
        }
