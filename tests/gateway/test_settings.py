from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.app.settings import ConfigError, load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_minimal_file_loads_with_defaults(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "pools:\n  - {name: p, model: m, endpoints: [{url: 'http://h:1/v1/'}]}\n"))
    assert settings.server.port == 8080
    assert settings.pools[0].endpoints[0].url == "http://h:1"
    assert settings.resolve_path(settings.policies) == tmp_path / "policies.yaml"


def test_error_names_file_key_path_and_expectation(tmp_path: Path) -> None:
    path = write(tmp_path, "server: {port: 'eighty'}\npools: []\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert str(path) in message
    assert "server.port" in message
    assert "integer" in message


def test_error_inside_a_list_names_the_index(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pools:\n  - {name: ok, model: m, endpoints: [{url: 'http://h:1'}]}\n"
        "  - {name: bad, model: m, endpoints: [{url: 'ftp://h'}]}\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert "pools[1].endpoints[0].url" in str(caught.value)


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, "server: {prot: 1}\n"))
    assert "server.prot" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("server: {prot: 1}\n", "server.prot: unknown key; did you mean 'port'?"),
        ("routing: {prefix_index: {mdoe: off}}\n", "routing.prefix_index.mdoe: unknown key; did you mean 'mode'?"),
        (
            "routing: {pools: {p: {pd: {min_uncachd_tokens: 1}}}}\n",
            "routing.pools.p.pd.min_uncachd_tokens: unknown key; did you mean 'min_uncached_tokens'?",
        ),
        (
            "pools:\n  - {name: p, model: m, endpoints: [{url: 'http://h:1', rol: both}]}\n",
            "pools[0].endpoints[0].rol: unknown key; did you mean 'role'?",
        ),
        ("ledger: {zzz: 1}\n", "ledger.zzz: unknown key; valid keys here: audit, commit_interval_ms, dir, enabled,"),
        (
            "pools:\n  - {name: p, model: m, engine: vlm, endpoints: [{url: 'http://h:1'}]}\n",
            "pools[0].engine: Input should be 'sim', 'vllm', 'trtllm', 'vllm-ascend', 'openai', 'anthropic', "
            "'bedrock', 'gemini' or 'azure-openai'; did you mean 'vllm'?",
        ),
    ],
)
def test_a_misspelled_key_names_the_nearest_valid_one(tmp_path: Path, text: str, line: str) -> None:
    """Every section is typed, so the suggestion reaches into lists, mappings and the rooms' models."""
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    assert line in str(caught.value)


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [
        ("predictor: {xgboost: {n_trees: 10}}\n", "predictor.xgboost", "predictor.advanced.xgboost"),
        (
            "routing: {prefix_index: {max_prefix_tokens: 4096}}\n",
            "routing.prefix_index.max_prefix_tokens",
            "routing.prefix_index.advanced.max_prefix_tokens",
        ),
        ("state: {replicas: {ttl_s: 5}}\n", "state.replicas.ttl_s", "state.replicas.advanced.ttl_s"),
        ("flow_control: {recheck_ms: 10}\n", "flow_control.recheck_ms", "flow_control.advanced.recheck_ms"),
    ],
)
def test_an_expert_tunable_at_its_old_place_names_its_new_one(tmp_path: Path, text: str, old: str, new: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    assert f"{old}: moved to `{new}`" in str(caught.value)
    nested = new.split(".")
    value: object = 10
    for part in reversed(nested):
        value = {part: value}
    assert isinstance(value, dict)
    path = tmp_path / "moved.yaml"
    path.write_text(yaml.safe_dump(value))
    if nested[-1] != "xgboost":
        load_settings(path)  # the new place loads


def test_every_section_is_validated_at_load(tmp_path: Path) -> None:
    """A mistake in a room's section stops the load itself, not the code that reads it later."""
    for text, where in [
        ("predictor: {min_samples: 1}\n", "predictor.min_samples"),
        ("batch: {runner: {max_attempts: 0}}\n", "batch.runner.max_attempts"),
        ("flow_control: {max_queued: 0}\n", "flow_control.max_queued"),
        ("epp: {port: 0}\n", "epp.port"),
        ("routing: {default: {picker: {type: nope}}}\n", "routing.default"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_settings(write(tmp_path, text))
        assert where in str(caught.value), text
    settings = load_settings(write(tmp_path, "flow_control: {max_queued: 7}\nepp: {port: 9100}\n"))
    assert settings.flow_control.max_queued == 7 and settings.epp.port == 9100


def test_env_references_are_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TW_TEST_UPSTREAM_KEY", "secret-1")
    text = "pools:\n  - {name: p, model: m, api_key: '${TW_TEST_UPSTREAM_KEY}', endpoints: [{url: 'http://h:1'}]}\n"
    settings = load_settings(write(tmp_path, text))
    assert settings.pools[0].api_key == "secret-1"


def test_missing_env_reference_is_a_config_error(tmp_path: Path) -> None:
    text = "server: {admin_token: '${TW_TEST_SURELY_UNSET_VAR}'}\n"
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    assert "TW_TEST_SURELY_UNSET_VAR" in str(caught.value)
    assert "server.admin_token" in str(caught.value)


def test_env_default_is_used(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "server: {admin_token: '${TW_TEST_SURELY_UNSET_VAR:-fallback}'}\n"))
    assert settings.server.admin_token == "fallback"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("- a\n- b\n", "mapping", id="top-level-list"),
        pytest.param("server: {port: [1\n", "YAML", id="broken-yaml"),
    ],
)
def test_unreadable_files(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    assert fragment in str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(tmp_path / "nope.yaml")
