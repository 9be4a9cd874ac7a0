"""`apis:` in gateway.yaml: limits of the stored responses (Responses API `store`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ResponseStoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="a stored response is forgotten after this")
    max_responses: int = Field(default=10_000, ge=1, description="per process (memory) or per API key (Redis)")
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1, description="all stored responses of the process (memory)")
    max_response_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="larger conversations are not stored")


class ApisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_store: ResponseStoreSettings = Field(default_factory=ResponseStoreSettings)
