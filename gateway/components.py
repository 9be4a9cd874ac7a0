"""The parts the request pipeline calls, as small protocols, plus the inert defaults used when a part
is switched off in gateway.yaml. The app factory builds the real ones; the pipeline never asks which
kind it holds. (Tracing's protocol and no-op live in `gateway.telemetry.tracing`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.record import RequestRecord
from policies.types import RequestFacts, Usage


class Ticket(Protocol):
    """An admission's reservation; `headers` are the x-ratelimit-* of the tightest bucket."""

    headers: tuple[tuple[str, str], ...]


class AdmissionPort(Protocol):
    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> Any: ...

    async def settle(
        self, ticket: Any, usage: Usage | None, *, model: str, charged_output_tokens: int | None = None
    ) -> None: ...

    async def release(self, ticket: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class OpenTicket:
    headers: tuple[tuple[str, str], ...] = ()


class OpenAdmission:
    """No limits configured: everything is admitted and nothing is reserved."""

    _ticket = OpenTicket()

    async def admit(self, facts: RequestFacts, model: str, now: float | None = None) -> OpenTicket:
        return self._ticket

    async def settle(
        self, ticket: Any, usage: Usage | None, *, model: str, charged_output_tokens: int | None = None
    ) -> None:
        return None

    async def release(self, ticket: Any) -> None:
        return None


class RecordSink(Protocol):
    """Receives every finished request exactly once (metrics, ledger, predictor feedback)."""

    def observe(self, record: RequestRecord) -> None: ...
