"""docs/configuration.md is generated from the settings tree: it must match what the loader accepts."""

from __future__ import annotations

import re

import pytest

from gateway.app.config_doc import COMMAND, DOC_PATH, main, render
from gateway.app.settings import MOVED_TO_ADVANCED, GatewaySettings


@pytest.mark.slow
def test_the_committed_reference_is_current() -> None:
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
    assert current == render(), f"docs/configuration.md is stale: regenerate it with `{COMMAND}`"


@pytest.mark.slow
def test_check_mode_says_whether_it_is_stale() -> None:
    assert main(["--check"]) == (0 if DOC_PATH.read_text(encoding="utf-8") == render() else 1)


def rows() -> dict[str, list[str]]:
    found = {}
    for line in render().splitlines():
        if line.startswith("| `"):
            key, *cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            found[key.strip("`")] = cells
    return found


def test_every_key_has_a_type_a_default_and_a_description() -> None:
    table = rows()
    leaves = {key: cells for key, cells in table.items() if not key.endswith(".*")}
    assert len(leaves) > 300
    assert not [key for key, cells in leaves.items() if not cells[0] or not cells[1]]
    undescribed = [key for key, cells in table.items() if len(cells) < 3 or not cells[-1]]
    assert undescribed == [], f"add description= to these fields, then run `{COMMAND}`"


def test_every_section_and_every_moved_key_is_there() -> None:
    table = rows()
    for section in GatewaySettings.model_fields:
        if section != "source":
            assert any(key == section or key.startswith((f"{section}.", f"{section}[")) for key in table), section
    for new in MOVED_TO_ADVANCED.values():
        assert new in table or f"{new}.*" in table, new
    assert len([key for key in table if ".advanced." in key and not key.endswith(".*")]) >= 40
    assert table["server.port"][1] == "`8080`"
    assert table["pools[].name"][1] == "required"
    assert "near-best-random" in table["routing.default.picker.type"][1]
