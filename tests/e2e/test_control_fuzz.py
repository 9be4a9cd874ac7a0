"""What the identity provider and the cluster API answer is input too: the chaos suite's control fuzz
(`bench/chaos/control_fuzz.py`) in the suite, smaller. A stand-in OpenID Connect provider answers each
console login with drawn answers (broken discovery documents, JWKS and token answers; ID tokens with
`alg: none`, other keys, claims wrong or of the wrong type) while the browser's callback parameters are
drawn too; a stand-in Kubernetes API server answers the pool's list and watch with drawn scripts
(slices of every wrong shape, garbage lines, cut streams, ERROR events, 410 loops). No 5xx but the
provider's documented 502, no session from an invalid answer, no bug in the log, only addresses
discovered and within the bound, and the watch still applies a valid slice afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import control_fuzz

pytestmark = pytest.mark.e2e


def test_whatever_the_provider_and_the_api_server_answer_the_gateway_holds(tmp_path: Path) -> None:
    result = control_fuzz.run(tmp_path, examples=30)
    assert result["examples"] >= 30 and result["valid_logins"] > 0, result  # logins reach the end, not only refusals
    assert control_fuzz.met(result), "\n".join(control_fuzz.section(result))
