"""The compose stack's Prometheus alert rules: loaded by prometheus.yml from a mounted file, well
formed, and querying only series the gateway exports (a renamed family would silence an alert)."""

from __future__ import annotations

import re

import yaml

from tests.deploy.test_compose import SERVICES, exported_families, host_file, option


def rules() -> list[dict[str, object]]:
    argv = SERVICES["prometheus"]["command"]
    config = yaml.safe_load(host_file("prometheus", option(argv, "--config.file")).read_text())
    found: list[dict[str, object]] = []
    for path in config["rule_files"]:
        for group in yaml.safe_load(host_file("prometheus", path).read_text())["groups"]:
            found.extend(group["rules"])
    return found


def test_alert_rules_are_loaded_and_query_exported_series() -> None:
    alerts = {str(rule["alert"]): rule for rule in rules()}
    assert "TokenwaySpendDrift" in alerts
    samples = {name for names in exported_families().values() for name in names}
    for name, rule in alerts.items():
        assert rule["for"] and rule["annotations"], name
        used = set(re.findall(r"\b(tokenway_[a-z0-9_]+)", str(rule["expr"]) + str(rule["annotations"])))
        assert used and used <= samples, f"{name} queries {sorted(used - samples)}, which nothing exports"
