"""`apis:` in gateway.yaml: limits of the stored responses (Responses API `store`).

Bounds are per owner (the API key that made the response) first: a key over its own count or bytes
loses its own oldest responses, never another key's. The process-wide bounds (`state: memory`) only
guard the process: when they are reached a new response is answered but not stored, again without
touching anyone else's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ResponseStoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="a stored response is forgotten after this")
    max_responses_per_key: int = Field(
        default=1000, ge=1, description="per API key (both backends): its own oldest are dropped beyond it"
    )
    max_bytes_per_key: int = Field(
        default=32 * 1024 * 1024, ge=1, description="per API key (both backends): its own oldest are dropped beyond it"
    )
    max_responses: int = Field(default=10_000, ge=1, description="the whole process (memory): beyond it, not stored")
    max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1, description="the whole process (memory): beyond it, not stored"
    )
    max_response_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="larger conversations are not stored")


class ApisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_store: ResponseStoreSettings = Field(default_factory=ResponseStoreSettings)
