import pytest
from pydantic import ValidationError

from policies.routing.config import RoutingConfig


def test_defaults_are_valid_and_complete() -> None:
    cfg = RoutingConfig()
    assert cfg.prefix_index.mode == "approximate"
    assert [s.type for s in cfg.default.scorers] == [
        "work-cost",
        "prefix-cache",
        "kv-usage",
        "queue-depth",
        "session-affinity",
    ]
    assert cfg.default.picker.type == "near-best-random"
    assert cfg.pd.min_uncached_tokens == 512


def test_pool_override_inherits_default_keys() -> None:
    cfg = RoutingConfig.model_validate(
        {
            "default": {"scorers": [{"type": "queue-depth", "weight": 2}]},
            "pools": {
                "a": {"picker": {"type": "max-score"}},
                "b": {"router": "round-robin"},
                "c": {"pd": {"min_uncached_tokens": 2048}},
            },
        }
    )
    assert [s.type for s in cfg.pipeline_for("a").scorers] == ["queue-depth"]
    assert cfg.pipeline_for("a").picker.type == "max-score"
    assert cfg.pipeline_for("b").router == "round-robin"
    assert cfg.pipeline_for("unlisted") is cfg.default
    assert cfg.pd_for("c").min_uncached_tokens == 2048
    assert cfg.pd_for("a").min_uncached_tokens == 512


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param({"default": {"scorers": [{"type": "nope"}]}}, "unknown scorer 'nope'", id="unknown-scorer"),
        pytest.param(
            {"default": {"filters": [{"type": "load-gate", "params": {"x": 1}}]}}, "bad params", id="bad-param"
        ),
        pytest.param(
            {"default": {"picker": {"type": "near-best-random", "params": {"tolerance": 5}}}},
            "tolerance",
            id="invalid-param-value",
        ),
        pytest.param({"default": {"scorers": [{"type": "kv-usage", "weight": 0}]}}, "weight > 0", id="no-weight"),
        pytest.param({"prefix_index": {"mode": "exact"}}, "mode", id="unknown-index-mode"),
        pytest.param({"unknown": 1}, "unknown", id="unknown-key"),
        pytest.param({"default": {"router": "magic"}}, "router", id="unknown-router"),
    ],
)
def test_invalid_configs_fail_with_a_precise_message(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RoutingConfig.model_validate(raw)


def test_yaml_example_from_docs_validates() -> None:
    import yaml

    doc = RoutingConfig.__module__
    text = __import__(doc, fromlist=["_"]).__doc__ or ""
    yaml_text = text.split("\n\n")[1]
    raw = yaml.safe_load(yaml_text)["routing"]
    cfg = RoutingConfig.model_validate(raw)
    assert cfg.pipeline_for("remote").router == "least-inflight"
    assert cfg.pd_for("llama-pd").min_uncached_tokens == 1024
