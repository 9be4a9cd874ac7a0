"""One stand-in per provider per test module (started as a process; see tests/sim/hosted/standin.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sim.hosted.standin import StandIn, standin


@pytest.fixture(scope="module")
def anthropic_standin() -> Iterator[StandIn]:
    with standin("anthropic") as running:
        yield running


@pytest.fixture(scope="module")
def azure_standin() -> Iterator[StandIn]:
    with standin("azure") as running:
        yield running
