"""What the engine-control tests send and who may send it, the same through the gateway
(tests/e2e/test_engine_control.py) and through the endpoint picker (tests/e2e/test_epp_engine_control.py):
the fields a client must never steer the engine with, and the policy of three tenants (an ordinary
one, a trusted one that may set two of those fields, a sheddable one) with a key each."""

from __future__ import annotations

from typing import Any

from policies.policy import hash_key
from tests.support.procs import TEST_KEY

TRUSTED_KEY = "sk-tokenway-trusted-01"
SHED_KEY = "sk-tokenway-shed-0001"
HOSTILE_FIELDS: dict[str, Any] = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "10.9.8.7",
        "remote_port": 5600,
        "remote_engine_id": "evil",
        "remote_request_id": "x",
        "remote_block_ids": [[1, 2, 3]],
    },
    "disaggregated_params": {"request_type": "generation_only"},
    "cache_salt": "my-salt",
    "request_id": "engine-id-clash",
    "vllm_xargs": {"kv_cache_report_mode": "full"},
    "priority": 2,
}


def engine_control_policies(model: str) -> dict[str, Any]:
    """policies.yaml for `model`: TEST_KEY's tenant may set nothing, TRUSTED_KEY's `cache_salt` and
    `priority`, SHED_KEY's tenant is sheddable."""
    return {
        "tenants": {
            "t1": {},
            "trusted": {"engine_fields": ["cache_salt", "priority"]},
            "batch": {"priority": "sheddable"},
        },
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "trusted", "sha256": hash_key(TRUSTED_KEY)},
            {"id": "k3", "tenant": "batch", "sha256": hash_key(SHED_KEY)},
        ],
        "models": {model: {}},
    }
