"""The backends room's exception tree.

    BackendsError                 any failure raised by backends code
    ├── PlanError                 pools cannot be planned: devices, ports, an adapter's constraints;
    │                             the message names the pool (a configuration error, never a retry)
    ├── MetricsFormatError        an engine's metrics payload is not what its adapter expects
    └── PdError                   prefill/decode disaggregation cannot proceed
        ├── PdUnsupportedError    the engine kind has no PD handshake (remote APIs)
        └── PdHandshakeError      the prefill leg's response lacks what the decode leg needs

Runtime failures of launched replicas (crash loops, startup timeouts) are not exceptions: they are
endpoint states with a reason and a log tail, so one failing pool never stops the others.
"""

from __future__ import annotations


class BackendsError(Exception):
    """Base of every error raised by the backends room."""


class PlanError(BackendsError, ValueError):
    """The pools as configured cannot be launched; the message says which pool and why."""


class MetricsFormatError(BackendsError, ValueError):
    """A metrics payload lacks the load metrics its engine kind always reports."""


class PdError(BackendsError):
    """Prefill/decode disaggregation cannot proceed for this request."""


class PdUnsupportedError(PdError):
    """The engine kind has no prefill/decode handshake."""


class PdHandshakeError(PdError):
    """The prefill leg's response lacks the parameters the decode leg needs."""
