"""Hot reload: a valid file applies to the next request, counters of unchanged rules survive, an
invalid file keeps the running policy and reports why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.holder import PolicyHolder
from policies.limits.admission import Admission, Admitted
from policies.limits.memory_store import MemoryStore
from policies.loader import PolicyFileError
from policies.policy import hash_key
from policies.types import Rejection, Usage
from tests.policies.limits.support import facts

T0 = 1_000_000.0


def write(path: Path, limits: list[dict[str, Any]]) -> None:
    doc = {
        "tenants": {"t": {}},
        "keys": [{"id": "k", "tenant": "t", "sha256": hash_key("sk")}],
        "models": {"big": {}},
        "limits": limits,
    }
    path.write_text(yaml.safe_dump(doc))


@pytest.mark.slow
async def test_a_valid_change_applies_to_the_next_request_and_keeps_unchanged_counters(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    write(path, [{"id": "per-key", "scope": "key", "tpm": 10_000}, {"scope": "tenant", "rpm": 2}])
    holder = PolicyHolder.from_file(path)
    adm = Admission(holder, MemoryStore())
    who = holder.current.authenticate("sk")
    assert who is not None
    for _ in range(2):
        ticket = await adm.admit(facts(who, prompt_tokens=0, max_tokens=3000), "big", now=T0)
        assert isinstance(ticket, Admitted)
    in_flight = ticket
    assert isinstance(await adm.admit(facts(who, prompt_tokens=0, max_tokens=1), "big", now=T0), Rejection)

    write(path, [{"id": "per-key", "scope": "key", "tpm": 10_000}, {"scope": "tenant", "rpm": 5}])
    result = holder.reload()
    assert result.ok and result.changed and result.generation == 2
    # rpm raised: the next request passes; the unchanged key bucket still holds the 6000 reserved
    nxt = await adm.admit(facts(who, prompt_tokens=0, max_tokens=1000), "big", now=T0)
    assert isinstance(nxt, Admitted)
    no = await adm.admit(facts(who, prompt_tokens=0, max_tokens=3500), "big", now=T0)
    assert isinstance(no, Rejection) and "Used 7000" in no.message
    # a request admitted under the old policy settles against the buckets it reserved
    assert isinstance(in_flight, Admitted)
    await adm.settle(in_flight, Usage(0, 0), model="big", now=T0)
    assert isinstance(await adm.admit(facts(who, prompt_tokens=0, max_tokens=3000), "big", now=T0), Admitted)


@pytest.mark.slow
async def test_an_invalid_file_keeps_the_old_policy_and_reports_the_error(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    write(path, [{"scope": "key", "rpm": 1}])
    holder = PolicyHolder.from_file(path)
    before = holder.current
    path.write_text("limits:\n  - scope: key\n    rpm: -3\n")
    result = holder.reload()
    assert not result.ok and holder.current is before and holder.generation == 1
    assert result.errors == (f"{path}:3: limits[0].rpm: expected greater than or equal to 1, got -3",)
    status = holder.status()
    assert status["last_error"] == list(result.errors) and status["generation"] == 1
    write(path, [{"scope": "key", "rpm": 2}])
    assert (await holder.reload_async()).ok and holder.status()["last_error"] is None


@pytest.mark.slow
def test_startup_refuses_an_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text("tenants: 3\n")
    with pytest.raises(PolicyFileError):
        PolicyHolder.from_file(path)
