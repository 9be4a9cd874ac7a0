"""Loading policies.yaml: precise messages (file, line, key path, expectation), ${ENV}, the example."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.loader import PolicyFileError, check_file, load_policy, parse_config
from policies.policy import hash_key

REPO = Path(__file__).resolve().parents[2]

BAD = """\
version: 1
admission:
  store_failure: maybe
tenants:
  demo: {}
keys:
  - id: k1
    tenant: demo
    sha256: "${MISSING_SECRET}"
models:
  llama:
    context_length: lots
limits:
  - scope: key
    tpm: 100
    colour: blue
  - scope: tenant
    match: {model: llama}
    rpm: 5
"""


def test_every_problem_is_reported_with_file_line_and_key_path(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(BAD)
    assert check_file(path, env={}) == [
        f"{path}:9: keys[0].sha256: environment variable MISSING_SECRET is not set (referenced as ${{MISSING_SECRET}})",
        f"{path}:3: admission.store_failure: expected 'fail_open' or 'fail_closed', got 'maybe'",
        f"{path}:12: models.llama.context_length: expected an integer, got 'lots'",
        f"{path}:16: limits[0].colour: unknown field (expected one of: calls_per_run, count, fallback, id, "
        "match, max_concurrent, rpd, rpm, scope, seconds_per_run, shadow, tokens_per_run, tpd, tpm, weights)",
        f"{path}:17: limits[1]: scope 'tenant' cannot match on model (expected org, team, tenant)",
    ]


def test_reference_problems_point_at_their_lines() -> None:
    text = "tenants: {t: {}}\nkeys:\n  - id: k\n    tenant: ghost\n    sha256: " + hash_key("x") + "\n"
    with pytest.raises(PolicyFileError) as info:
        parse_config(text, "p.yaml")
    assert info.value.messages == ["p.yaml:4: keys[0].tenant: unknown tenant 'ghost'"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tenants: [\n", "p.yaml:2: invalid YAML"),
        ("- just\n- a list\n", "p.yaml:1: expected a mapping at the top level, got list"),
        ("tenants: {}\ntenants: {}\n", "p.yaml:2: tenants: duplicate key (line 2)"),
        ("limits:\n  - scope: key\n    tpm: 0\n", "p.yaml:3: limits[0].tpm: expected greater than or equal to 1"),
    ],
    ids=["syntax", "not-a-mapping", "duplicate-key", "range"],
)
def test_structural_problems(text: str, expected: str) -> None:
    with pytest.raises(PolicyFileError) as info:
        parse_config(text, "p.yaml")
    assert any(m.startswith(expected) for m in info.value.messages), info.value.messages


def test_env_references_are_resolved_with_defaults() -> None:
    text = (
        "tenants: {t: {}}\nkeys:\n  - id: k\n    tenant: t\n    sha256: ${KEY_HASH}\n"
        "admission: {store_failure: '${MODE:-fail_closed}'}\n"
    )
    config = parse_config(text, env={"KEY_HASH": hash_key("x")})
    assert config.keys[0].sha256 == hash_key("x")
    assert config.admission.store_failure == "fail_closed"


def test_an_empty_file_is_an_empty_policy(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_policy(path).config.keys == []


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    (message,) = check_file(tmp_path / "nope.yaml")
    assert "nope.yaml: cannot read" in message


def test_the_shipped_example_is_valid_and_knows_the_demo_key() -> None:
    path = REPO / "config" / "policies.yaml"
    assert check_file(path) == []
    policy = load_policy(path)
    principal = policy.authenticate("tw-demo-key-0000")
    assert principal is not None and principal.tenant == "demo"
    assert policy.resolve_model("gpt-4o-mini") == "llama-3.1-8b"
    assert [step.model for step in policy.fallbacks("llama-3.1-8b")] == ["qwen2.5-7b"]


def test_yaml_on_is_caught_with_a_hint() -> None:
    text = "models:\n  a:\n    fallbacks:\n      - model: b\n        on: [rate_limited]\n  b: {}\n"
    with pytest.raises(PolicyFileError) as info:
        parse_config(text, "p.yaml")
    assert info.value.messages == [
        "p.yaml:4: models.a.fallbacks[0]: YAML reads `on:` as true; name the list `triggers:`"
    ]
