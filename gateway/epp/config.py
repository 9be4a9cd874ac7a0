"""`epp:` in gateway.yaml: the ext_proc gRPC listener of `tokenway epp`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="0.0.0.0", description="where Envoy's ext_proc filter connects")
    port: int = Field(default=9002, ge=1, le=65535, description="the Inference Extension's default EPP port")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="larger request bodies are a 413")
    request_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = Field(
        default="FULL_DUPLEX_STREAMED",
        description="the ext_proc request body mode the data plane is configured with, assumed when Envoy "
        "does not announce it (protocol_config); the Inference Extension's gateways use FULL_DUPLEX_STREAMED",
    )
    grace_s: float = Field(default=10.0, ge=0, description="SIGTERM: open exchanges finish within")
