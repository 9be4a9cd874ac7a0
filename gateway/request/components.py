"""The parts the walk of a request calls, as small protocols: the walk never asks which kind it
holds. (Tracing's protocol and its no-op live in `gateway.telemetry.tracing`.)
"""

from __future__ import annotations

from typing import Protocol

from gateway.request.record import RequestRecord
from policies.limits.admission import Admitted
from policies.types import Rejection, RequestFacts, Usage


class AdmissionPort(Protocol):
    """`policies.limits.admission.Admission`'s contract as the walk uses it: `admit`, then exactly one
    of `settle` or `release` per `Admitted` ticket."""

    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Admitted | Rejection: ...

    async def settle(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> None: ...

    async def release(self, ticket: Admitted) -> None: ...

    def settle_soon(
        self,
        ticket: Admitted,
        usage: Usage | None,
        *,
        model: str,
        charged_output_tokens: int | None = None,
        pool: str | None = None,
    ) -> object:
        """`settle` begun now and finished in the background (the walk does not wait for the store);
        `pool`, the pool that served it, picks its price (`pool_prices`)."""

    def release_soon(self, ticket: Admitted) -> object:
        """`release` begun now and finished in the background."""


class RecordSink(Protocol):
    """Receives every finished request exactly once (metrics, ledger)."""

    def observe(self, record: RequestRecord) -> None: ...
