import re

import pytest

from policies.routing import components


@pytest.mark.parametrize("kind", ["filter", "scorer", "picker"])
def test_names_are_kebab_case_and_factories_build_with_defaults(kind: str) -> None:
    for name in components.REGISTRIES[kind]:
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", name), name
        assert components.build(kind, name, {}) is not None


@pytest.mark.parametrize(
    ("kind", "name", "params", "message"),
    [
        pytest.param("scorer", "nope", {}, "unknown scorer", id="unknown"),
        pytest.param("scorer", "work-cost", {"colour": 1}, "bad params", id="unknown-param"),
        pytest.param("filter", "load-gate", {"rel_threshold": 0.1}, "rel_threshold", id="invalid-value"),
    ],
)
def test_build_errors(kind: str, name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        components.build(kind, name, params)


def test_registries_are_read_only() -> None:
    with pytest.raises(TypeError):
        components.SCORERS["x"] = object  # type: ignore[index]


def test_every_scorer_declares_its_inputs_and_formula() -> None:
    for name, factory in components.SCORERS.items():
        assert getattr(factory, "consumes", None), name
        assert "Range" in (factory.__doc__ or ""), name
