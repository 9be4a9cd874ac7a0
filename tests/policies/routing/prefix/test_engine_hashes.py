import pytest

from backends.block_hash import hash_blocks
from policies.routing.prefix_blocks import ENGINE_HASHERS, token_bytes
from tests.policies.routing.factories import token_ids


@pytest.mark.parametrize(
    ("n_tokens", "block", "salt"),
    [
        pytest.param(100, 16, None, id="unsalted"),
        pytest.param(100, 16, "tenant-a", id="salted"),
        pytest.param(15, 16, None, id="no-full-block"),
        pytest.param(4096, 32, "s", id="other-block-size"),
    ],
)
def test_sim_hasher_equals_the_engines_own(n_tokens: int, block: int, salt: str | None) -> None:
    ids = token_ids(n_tokens)
    assert ENGINE_HASHERS["sim"](token_bytes(ids), block, salt) == hash_blocks(ids, block, salt)


def test_vllm_is_matched_by_token_keys() -> None:
    assert "vllm" not in ENGINE_HASHERS
