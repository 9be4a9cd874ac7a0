from __future__ import annotations

import pytest

from backends.config import PoolConfig, StaticEndpointConfig
from backends.fleet import Fleet
from backends.types import EndpointState, Role


def pd_fleet() -> Fleet:
    return Fleet.from_configs(
        [
            PoolConfig(
                name="pd",
                model="m",
                engine="vllm",
                endpoints=[
                    StaticEndpointConfig.model_validate(
                        {"url": "http://p:1", "role": "prefill", "kv_events_replay_endpoint": "tcp://p:5558"}
                    ),
                    StaticEndpointConfig.model_validate({"url": "http://d:1", "role": "decode"}),
                ],
            )
        ]
    )


@pytest.mark.parametrize(
    ("prefill", "decode", "ready"),
    [
        pytest.param(EndpointState.READY, EndpointState.STARTING, False, id="only-prefill-ready"),
        pytest.param(EndpointState.STARTING, EndpointState.READY, True, id="decode-ready"),
        pytest.param(EndpointState.READY, EndpointState.READY, True, id="both-ready"),
    ],
)
def test_a_pd_pool_is_ready_only_with_a_decoding_endpoint(
    prefill: EndpointState, decode: EndpointState, ready: bool
) -> None:
    fleet = pd_fleet()
    by_role = {e.role: e for e in fleet.pools["pd"].endpoints}
    by_role[Role.PREFILL].state, by_role[Role.DECODE].state = prefill, decode
    assert fleet.pools["pd"].has_ready is ready


def test_static_endpoints_carry_their_kv_event_replay_socket() -> None:
    prefill = next(e for e in pd_fleet().endpoints() if e.role is Role.PREFILL)
    assert prefill.kv_events_replay_endpoint == "tcp://p:5558"
