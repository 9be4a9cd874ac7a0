"""The schema of config/policies.yaml (pydantic: config only, never per request).

Tenants own keys; keys are stored as SHA-256 hex digests, never in clear. Models declare their
aliases, context length, price and fallback chain. Limits, budgets and SLO classes extend this file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PriorityName = Literal["critical", "high", "normal", "low", "sheddable"]
PRIORITY_VALUES: dict[str, int] = {"critical": 2, "high": 1, "normal": 0, "low": -1, "sheddable": -2}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantConfig(_Strict):
    models: list[str] | None = Field(default=None, description="allowed public models; null = all")
    priority: PriorityName = "normal"
    allow_fallback: bool = True


class KeyConfig(_Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    tenant: str
    sha256: str = Field(description="hex SHA-256 of the key; `tokenway keys create` prints it")
    models: list[str] | None = Field(default=None, description="narrows the tenant's models")
    priority: PriorityName | None = None
    disabled: bool = False

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("expected 64 hex characters (SHA-256 of the key)")
        return value


class PriceConfig(_Strict):
    """USD per million tokens."""

    input_per_mtok: float = Field(default=0.0, ge=0)
    cached_input_per_mtok: float | None = Field(default=None, ge=0, description="defaults to input")
    output_per_mtok: float = Field(default=0.0, ge=0)


class ModelConfig(_Strict):
    aliases: list[str] = Field(default_factory=list)
    context_length: int | None = Field(default=None, ge=1, description="prompt + max_tokens limit")
    default_max_tokens: int = Field(default=1024, ge=1, description="output reservation without max_tokens")
    price: PriceConfig = Field(default_factory=PriceConfig)


class PoliciesConfig(_Strict):
    version: Literal[1] = 1
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[KeyConfig] = Field(default_factory=list)
    models: dict[str, ModelConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references(self) -> PoliciesConfig:
        seen_ids: set[str] = set()
        seen_hashes: set[str] = set()
        for i, key in enumerate(self.keys):
            if key.tenant not in self.tenants:
                raise ValueError(f"keys[{i}].tenant: unknown tenant {key.tenant!r}")
            if key.id in seen_ids:
                raise ValueError(f"keys[{i}].id: duplicate key id {key.id!r}")
            if key.sha256 in seen_hashes:
                raise ValueError(f"keys[{i}].sha256: the same key hash appears twice")
            seen_ids.add(key.id)
            seen_hashes.add(key.sha256)
        owners: dict[str, str] = {}
        for name, model in self.models.items():
            for alias in model.aliases:
                if alias in self.models or alias in owners:
                    raise ValueError(f"models.{name}.aliases: {alias!r} is already a model or alias")
                owners[alias] = name
        return self
