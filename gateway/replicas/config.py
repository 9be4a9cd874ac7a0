"""`state.replicas` in gateway.yaml: how replicas share their routing state (needs `state: redis`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ReplicasSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    share: bool | None = Field(
        default=None, description="publish and fold routing state through Redis; default: on with `backend: redis`"
    )
    id: str | None = Field(
        default=None, description="this replica's name in shared state; default host-pid-random (use ${POD_NAME})"
    )
    publish_interval_ms: float = Field(
        default=2.0,
        gt=0,
        description="batches go out at most this often: load reports this late make prefix holders look busy",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, description="the load report is repeated this often unchanged")
    ttl_s: float = Field(
        default=3.0, gt=0, description="a replica silent this long no longer counts (its load ages out)"
    )
    stream_max_len: int = Field(default=20_000, ge=100, description="entries Redis keeps (approximate trim)")
    bootstrap_entries: int = Field(default=5_000, ge=0, description="recent entries a starting replica replays")
    max_pending_dispatches: int = Field(
        default=20_000, ge=1, description="dispatches waiting for the next batch; beyond, the oldest are dropped"
    )
    max_keys_per_dispatch: int = Field(
        default=2_048, ge=1, description="block keys shared per dispatch (the prompt's head: it is what others hit)"
    )
