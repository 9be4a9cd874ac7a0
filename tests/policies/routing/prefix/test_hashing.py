import pytest

from policies.routing.prefix_blocks import (
    PromptBlocks,
    block_key,
    canonical_prompt_bytes,
    chain_hashes,
    prompt_blocks,
    seed_of,
    token_bytes,
)
from tests.policies.routing.factories import prompt, token_ids


def keys_of(ids: list[int], seed: int = 1, block: int = 16) -> list[int]:
    return chain_hashes(token_bytes(ids), block * 4, seed, 10_000)


@pytest.mark.parametrize(
    ("a", "b", "shared_blocks"),
    [
        pytest.param(token_ids(64), token_ids(64), 4, id="identical"),
        pytest.param(token_ids(64), token_ids(40) + token_ids(24, start=9), 2, id="diverge-in-block-2"),
        pytest.param(token_ids(64), token_ids(64, start=5), 0, id="different"),
        pytest.param(token_ids(64), token_ids(70), 4, id="partial-tail-ignored"),
    ],
)
def test_equal_keys_mean_equal_prefixes(a: list[int], b: list[int], shared_blocks: int) -> None:
    ka, kb = keys_of(a), keys_of(b)
    shared = 0
    for x, y in zip(ka, kb, strict=False):
        if x != y:
            break
        shared += 1
    assert shared == shared_blocks
    assert ka[shared:] != kb[shared : len(ka)] or shared == len(ka)


def test_chain_equals_block_by_block_keys() -> None:
    ids = token_ids(48)
    parent = seed_of("x")
    expected = []
    for i in range(3):
        parent = block_key(ids[i * 16 : (i + 1) * 16], parent)
        expected.append(parent)
    assert keys_of(ids, seed=seed_of("x")) == expected


@pytest.mark.parametrize(
    ("parts_a", "parts_b"),
    [
        pytest.param(("m", None), ("m", "salt"), id="salt"),
        pytest.param(("m1", None), ("m2", None), id="model"),
        pytest.param(("ab", "c"), ("a", "bc"), id="separator"),
    ],
)
def test_seeds_separate_namespaces(parts_a: tuple[str, str | None], parts_b: tuple[str, str | None]) -> None:
    assert seed_of(*parts_a) != seed_of(*parts_b)


def test_max_blocks_bounds_hashing() -> None:
    assert len(chain_hashes(token_bytes(token_ids(1000)), 64, 0, 5)) == 5


@pytest.mark.parametrize(
    ("matched", "expected"),
    [
        pytest.param(0, 0, id="none"),
        pytest.param(2, 32, id="blocks-times-size"),
        pytest.param(4, 63, id="never-the-whole-prompt"),
    ],
)
def test_cached_tokens(matched: int, expected: int) -> None:
    assert PromptBlocks([1, 2, 3, 4], 16, 64, True).cached_tokens(matched) == expected


def test_prompt_blocks_cached_per_request() -> None:
    f = prompt(token_ids(256))
    first = prompt_blocks(f, 16, 1, 10_000, namespace="n")
    assert first is not None and len(first.keys) == 16 and first.exact
    assert prompt_blocks(f, 16, 1, 10_000, namespace="n") is first


def test_text_fallback_without_token_ids() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 1000}], "tools": [{"type": "function"}]}
    blocks = prompt_blocks(prompt(None, body=body), 16, 1, 10_000, namespace="n")
    assert blocks is not None and not blocks.exact and len(blocks.keys) == len(canonical_prompt_bytes(body)) // 64
    assert prompt_blocks(prompt(None, body=body), 16, 1, 10_000, namespace="p", require_ids=True) is None


@pytest.mark.parametrize(
    ("body_a", "body_b", "equal"),
    [
        pytest.param(
            {"messages": [{"role": "user", "content": "a"}]},
            {"messages": [{"content": "a", "role": "user"}]},
            True,
            id="key-order",
        ),
        pytest.param({"prompt": "abc"}, {"prompt": "abd"}, False, id="completion-prompt"),
        pytest.param(
            {"messages": [], "tools": [{"a": 1}]}, {"messages": [], "tools": [{"a": 2}]}, False, id="tools-count"
        ),
    ],
)
def test_canonical_prompt_bytes(body_a: dict[str, object], body_b: dict[str, object], equal: bool) -> None:
    assert (canonical_prompt_bytes(body_a) == canonical_prompt_bytes(body_b)) is equal
