"""policies.yaml's `flow_control` section: per band, how long a request may wait and what it gets then.

```yaml
flow_control:
  fairness: vtc                    # inside a band: virtual token counters (vtc) or arrival order
  shortest_job_first: false        # inside one tenant: least predicted cost first (else arrival order)
  bands:
    normal:    {max_queue_ms: 10000, on_timeout: 429}
    sheddable: {max_queue_ms: 2000,  on_timeout: fallback}
```

`on_timeout`: `429` (`rate_limit_exceeded`, type `requests`), `503` (`server_error` /
`queue_timeout`), both with retry-after from the queue's drain rate, or `fallback` (the model's chain
with trigger `queue_timeout`; 503 when no step takes it). Bands left out keep their defaults.
Tenant weights are `tenants.<name>.weight` (default 1).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

OnTimeout = Literal[429, 503, "fallback"]

# critical waits longest: it is what the capacity is for; sheddable traffic is dropped soonest
DEFAULT_BAND_QUEUE_MS: dict[str, float] = {
    "critical": 30_000.0,
    "high": 15_000.0,
    "normal": 10_000.0,
    "low": 5_000.0,
    "sheddable": 2_000.0,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BandPolicy(_Strict):
    max_queue_ms: float = Field(gt=0, description="longest wait in the gateway before on_timeout applies")
    on_timeout: OnTimeout = Field(default=503, description="429, 503 (with retry-after) or fallback")

    @model_validator(mode="before")
    @classmethod
    def _status_as_text(cls, value: object) -> object:
        """`on_timeout: "429"` (quoted) means the same as `on_timeout: 429`."""
        if isinstance(value, dict) and value.get("on_timeout") in ("429", "503"):
            return {**value, "on_timeout": int(value["on_timeout"])}
        return value


class ProgramFairness(_Strict):
    """`tenants.<name>.program_fairness`: inside the tenant's share, its programs go by least attained
    service (policies/flow/programs.py)."""

    half_life_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="a program's attained service (tokens served) halves every this many seconds",
    )


def _default_bands() -> dict[str, BandPolicy]:
    return {name: BandPolicy(max_queue_ms=ms) for name, ms in DEFAULT_BAND_QUEUE_MS.items()}


# built once: `FlowPolicy.band` runs per request, and the models are frozen, so one set serves all
_DEFAULT_BANDS: dict[str, BandPolicy] = _default_bands()


class FlowPolicy(_Strict):
    fairness: Literal["vtc", "arrival"] = Field(
        default="vtc", description="inside a band: least virtual counter first (vtc) or arrival order"
    )
    shortest_job_first: bool = Field(default=False, description="inside one tenant, least predicted cost first")
    bands: dict[Literal["critical", "high", "normal", "low", "sheddable"], BandPolicy] = Field(
        default_factory=dict, description="per band; bands left out keep their defaults"
    )

    def band(self, name: str) -> BandPolicy:
        found = self.bands.get(name)  # type: ignore[call-overload]
        return found if found is not None else _DEFAULT_BANDS[name]
