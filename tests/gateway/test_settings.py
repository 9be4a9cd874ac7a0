from __future__ import annotations

from pathlib import Path

import pytest

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
