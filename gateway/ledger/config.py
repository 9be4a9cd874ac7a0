"""The `ledger:` section of gateway.yaml (pydantic: config only, read once at startup).

```yaml
ledger:
  enabled: true
  dir: var/usage               # one directory per gateway replica (or a distinct file_prefix each)
  file_prefix: usage           # usage-YYYYMMDD-NNN.jsonl
  commit_interval_ms: 100      # a record is written within this long of its append
  rotate_bytes: 134217728      # start a new file past 128 MiB (and at each UTC midnight)
  retain_days: 90              # delete files older than this; null keeps everything
  redis_stream:                # optional: also XADD every record for collection from many replicas
    url: redis://redis:6379/0
    stream: tokenway:usage
    maxlen: 1000000            # approximate (MAXLEN ~) cap on the stream's length
```
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RedisStreamConfig(_Strict):
    url: str = Field(description="redis://host:port/db (use ${ENV} for a password)")
    stream: str = "tokenway:usage"
    maxlen: int = Field(default=1_000_000, ge=1, description="approximate cap (XADD MAXLEN ~)")
    timeout_s: float = Field(default=2.0, gt=0)
    max_pending_batches: int = Field(default=256, ge=1, description="beyond this, oldest batches are dropped")


class LedgerConfig(_Strict):
    enabled: bool = True
    dir: str = "var/usage"
    file_prefix: str = Field(default="usage", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    commit_interval_ms: int = Field(default=100, ge=1, le=60_000)
    rotate_bytes: int = Field(default=128 * 1024 * 1024, ge=4096)
    retain_days: int | None = Field(default=None, ge=1)
    fsync: bool = Field(default=True, description="fsync each group (survives power loss, not only crashes)")
    max_pending_records: int = Field(
        default=200_000, ge=1, description="records waiting for the disk beyond this are dropped and counted"
    )
    redis_stream: RedisStreamConfig | None = None
