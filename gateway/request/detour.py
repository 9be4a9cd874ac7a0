"""One way to say "not here, instead".

A context too long for the model, an admission rejection, every endpoint of the model failing before
the first byte, an SLO the model cannot meet: each is a `Detour` raised by the stage (or hook) that
found it. The director catches it in one place, releases the model's reservation, and walks the
model's fallback chain with `trigger`; when no fallback applies, `error` is the answer.
"""

from __future__ import annotations

from gateway.errors import GatewayError


class Detour(Exception):
    """The current model cannot serve the request: try the chain's next model for `trigger`, else
    answer `error`. `fallback=False` answers at once (a policy that says "reject", not "fall back")."""

    def __init__(self, trigger: str, error: GatewayError, *, fallback: bool = True) -> None:
        super().__init__(error.message)
        self.trigger = trigger
        self.error = error
        self.fallback = fallback
