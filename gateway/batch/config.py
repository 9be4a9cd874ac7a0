"""`batch:` in gateway.yaml: where files and batches live, how large they may be, how batch lines run.

```yaml
batch:
  enabled: true
  dir: var/batch                  # state: memory|embedded default: files and per-line progress on disk
  max_file_bytes: 209715200       # one uploaded file (OpenAI's limit: 200 MB)
  max_lines: 50000                # requests in one file (OpenAI's limit)
  tenant:                         # bounded storage, per tenant (every key of the tenant together)
    max_files: 500                # uploaded and output files kept
    max_bytes: 2147483648         # their bytes
    max_batches: 1000             # batch objects kept (finished ones are dropped oldest first)
    max_active_batches: 20        # batches not yet finished
  file_ttl_s: 2592000             # uploaded and output files expire after 30 days (OpenAI's default)
  runner:
    max_lines_in_flight: 64       # this process, every batch together
    max_lines_per_endpoint: 8     # batch lines running on one engine at once
    max_attempts: 3               # a line whose upstream fails (5xx) is tried this often
    lease_s: 60                   # state: redis: a claimed line is re-run by another replica after this
  spare:                          # what "spare capacity" means (policies/batch.py)
    max_engine_waiting: 0
    max_kv_usage_ratio: 0.6
    slo_headroom: 0.5
    paced_starts: false           # true: one line at a time in its predicted prefill per engine
```

With `state: redis` files, batches and progress live in Redis instead (every replica sees every
batch; lines are claimed so two replicas never run the same line) and `dir` is unused.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gateway.batch.objects import MAX_LINES
from policies.batch import SpareLimits

_DAY_S = 24 * 3600.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantStorage(_Strict):
    max_files: int = Field(default=500, ge=1, description="uploaded and output files kept per tenant")
    max_bytes: int = Field(default=2 * 1024**3, ge=1, description="their bytes, per tenant")
    max_batches: int = Field(default=1000, ge=1, description="batch objects kept per tenant")
    max_active_batches: int = Field(default=20, ge=1, description="batches not finished yet, per tenant")


class RunnerSettings(_Strict):
    max_lines_in_flight: int = Field(default=64, ge=1, description="this process, all batches together")
    max_lines_per_endpoint: int = Field(default=8, ge=1, description="batch lines running on one engine")
    max_attempts: int = Field(default=3, ge=1, description="tries of a line whose upstream fails (5xx)")
    lease_s: float = Field(default=60.0, ge=1.0, description="Redis: a silent replica's claim expires after")
    tick_s: float = Field(default=0.25, gt=0, description="the runner looks for spare capacity this often")
    retry_min_s: float = Field(default=0.5, gt=0, description="a deferred line waits at least this")
    retry_max_s: float = Field(default=30.0, gt=0, description="and at most this")


class SpareSettings(_Strict):
    """Batch runs only on spare capacity; these say what spare means (policies/batch.py)."""

    max_engine_waiting: int = Field(default=0, ge=0, description="requests queued in the engine")
    max_kv_usage_ratio: float = Field(
        default=0.6, gt=0, le=1.0, description="a line starts only on an engine whose KV cache is at most this full"
    )
    max_endpoint_inflight: int | None = Field(default=None, ge=1, description="all requests on one engine")
    slo_headroom: float = Field(
        default=0.5, gt=0, le=1.0, description="share of the tightest interactive objective a line's prediction may use"
    )
    max_stats_age_s: float = Field(default=2.0, gt=0, description="older engine stats count as busy")
    paced_starts: bool = Field(
        default=False, description="a new line waits until the last one placed on the engine is past its predicted TTFT"
    )

    def limits(self, max_lines_per_endpoint: int) -> SpareLimits:
        return SpareLimits(
            max_lines_per_endpoint=max_lines_per_endpoint,
            max_engine_waiting=self.max_engine_waiting,
            max_kv_usage_ratio=self.max_kv_usage_ratio,
            max_endpoint_inflight=self.max_endpoint_inflight,
            slo_headroom=self.slo_headroom,
            max_stats_age_s=self.max_stats_age_s,
            paced_starts=self.paced_starts,
        )


class BatchSettings(_Strict):
    enabled: bool = Field(default=True, description="serve /v1/files and /v1/batches and run batch lines")
    dir: str = Field(default="var/batch", description="embedded store (state: memory): files and progress")
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024, ge=1024, description="one uploaded file (OpenAI's limit: 200 MB)"
    )
    max_lines: int = Field(default=50_000, ge=1, le=MAX_LINES, description="requests in one file (OpenAI's limit)")
    tenant: TenantStorage = Field(
        default_factory=TenantStorage, description="bounded storage per tenant (every key of the tenant together)"
    )
    file_ttl_s: float = Field(default=30 * _DAY_S, gt=0, description="files expire after this")
    batch_ttl_s: float = Field(default=30 * _DAY_S, gt=0, description="finished batch objects are kept this long")
    completion_window_s: float = Field(default=_DAY_S, gt=0, description="'24h': unfinished lines expire after")
    fsync: bool = Field(default=True, description="a line's result is on disk (fsync) before it counts as done")
    runner: RunnerSettings = Field(default_factory=RunnerSettings, description="how batch lines run")
    spare: SpareSettings = Field(default_factory=SpareSettings, description="what spare capacity means")
