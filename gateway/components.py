"""The parts the request pipeline calls, as small protocols: the pipeline never asks which kind it
holds. (Tracing's protocol and its no-op live in `gateway.telemetry.tracing`.)
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.record import RequestRecord
from policies.types import RequestFacts, Usage


class AdmissionPort(Protocol):
    """`policies.limits.admission.Admission`'s contract as the pipeline uses it."""

    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Any: ...

    async def settle(
        self, ticket: Any, usage: Usage | None, *, model: str, charged_output_tokens: int | None = None
    ) -> None: ...

    async def release(self, ticket: Any) -> None: ...


class RecordSink(Protocol):
    """Receives every finished request exactly once (metrics, ledger)."""

    def observe(self, record: RequestRecord) -> None: ...
