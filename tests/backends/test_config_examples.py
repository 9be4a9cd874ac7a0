"""Every deployment in config/examples/ loads as gateway.yaml and passes `tokenway pools plan`."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.plan import plan_replicas, render_plan
from gateway.app.settings import load_settings

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "config" / "examples").glob("*.yaml"))


def no_tool(tool: str) -> tuple[int, ...] | None:
    return None  # plans must not depend on the test machine's GPUs


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-example-not-a-real-key")


def test_the_issue_deployments_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"vllm-8b-4gpu.yaml", "vllm-70b-tp4-8gpu.yaml", "trtllm-8b.yaml", "vllm-ascend-8npu.yaml",
            "remote-fallback.yaml"} <= names  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_parses_and_plans(path: Path) -> None:
    settings = load_settings(path)
    backends = settings.backends
    assert settings.pools, "an example deploys at least one pool"
    text = render_plan(settings.pools, backends, detect=no_tool)
    assert "devices are not managed" not in text  # GPU examples say which GPU each replica gets
    assert "sk-example-not-a-real-key" not in text
    planned = plan_replicas(settings.pools, backends, detect=no_tool)
    for item in planned:
        assert item.endpoint_id in text and item.spec.argv[0] in text


def test_70b_replicas_get_disjoint_tp4_gpu_sets() -> None:
    path = next(p for p in EXAMPLES if p.name == "vllm-70b-tp4-8gpu.yaml")
    settings = load_settings(path)
    planned = plan_replicas(settings.pools, settings.backends, detect=no_tool)
    assert [p.spec.env["CUDA_VISIBLE_DEVICES"] for p in planned] == ["0,1,2,3", "4,5,6,7"]
    assert all("--tensor-parallel-size" in p.spec.argv and "4" in p.spec.argv for p in planned)


ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "config" / "gateway.yaml", ROOT / "deploy" / "gateway.compose.yaml", *EXAMPLES]


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_shipped_gateway_files_pass_check(path: Path) -> None:
    """Every gateway.yaml the repository ships loads as one typed tree and `tokenway check` finds no
    error in it (an expert tunable left at its old place, a preset the sim refuses, ...)."""
    from gateway.app.checks import check_files, errors

    assert errors(check_files(str(path), probe=False, unset=[])) == []


def test_the_image_default_loads() -> None:
    settings = load_settings(ROOT / "deploy" / "image" / "gateway.yaml")  # its policies.yaml comes with the image
    assert settings.pools
