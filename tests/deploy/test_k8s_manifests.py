"""deploy/k8s renders and is valid Kubernetes: each overlay is built with `kubectl kustomize` (the
kustomize that ships inside kubectl; no cluster is contacted) and every object is checked against
the Kubernetes OpenAPI schemas in strict mode (`kubernetes-validate`, offline). Then the things a
schema cannot see: the ConfigMap's gateway.yaml and policies.yaml are valid tokenway configs, the
probes point at the gateway's own health routes, selectors select, the RBAC grants exactly what
discovery needs, and the config is mounted in the way hot reload survives."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from backends.discovery.slices import SERVICE_NAME_LABEL
from gateway.app.settings import load_settings
from policies.loader import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["sim", "vllm-gpu"]  # the HTTP gateway in front of engines
EPP_OVERLAY = "gie-epp"  # tokenway as an InferencePool's endpoint picker (no HTTP gateway)
CRDS = {"InferencePool", "HTTPRoute"}  # not in Kubernetes' own schemas: checked field by field below
KUBERNETES_VERSION = "1.32"  # the oldest minor still supported upstream when this was written


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render deploy/k8s; .ci/run installs it"
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(K8S / "overlays" / request.param)


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_every_object_is_valid_kubernetes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_epp_overlay_is_valid_and_wires_the_pool_to_the_picker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = kustomize(K8S / "overlays" / EPP_OVERLAY)
    for doc in docs:
        if doc["kind"] not in CRDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "tokenway-gateway") not in kinds  # Envoy is the data plane here
    pool = one(docs, "InferencePool", "llama-8b")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool["spec"]) == {"selector", "targetPorts", "endpointPickerRef"}
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["failureMode"] in ("FailOpen", "FailClose")
    service = one(docs, "Service", picker["name"])
    grpc_port = next(p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"])
    assert grpc_port.get("appProtocol") == "http2"
    epp = one(docs, "Deployment", "tokenway-epp")["spec"]["template"]["spec"]
    container = epp["containers"][0]
    assert container["args"][:1] == ["epp"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    settings_doc = yaml.safe_load(one(docs, "ConfigMap", "tokenway-config")["data"]["gateway.yaml"])
    assert settings_doc["epp"]["port"] == 9002 == picker["port"]["number"]
    # tokenway discovers exactly the pods the InferencePool selects, on its target port
    kube = settings_doc["pools"][0]["discovery"]["kubernetes"]
    engines_service = one(docs, "Service", kube["service"])
    assert engines_service["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    target = next(p for p in engines_service["spec"]["ports"] if p["name"] == kube["port"])
    assert target["port"] == pool["spec"]["targetPorts"][0]["number"]
    route = one(docs, "HTTPRoute", "llama-8b")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == pool["metadata"]["name"]
    (tmp_path / "gateway.yaml").write_text(one(docs, "ConfigMap", "tokenway-config")["data"]["gateway.yaml"])
    (tmp_path / "policies.yaml").write_text(one(docs, "ConfigMap", "tokenway-config")["data"]["policies.yaml"])
    monkeypatch.setenv("TOKENWAY_ADMIN_TOKEN", "t")
    settings = load_settings(tmp_path / "gateway.yaml")
    assert settings.epp.port == 9002


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_the_validator_rejects_an_unknown_field() -> None:
    """Strict mode is what catches a misspelt key (readinesProbe) that Kubernetes would drop silently."""
    deployment = one(kustomize(K8S / "overlays" / "sim"), "Deployment", "tokenway-gateway")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_config_map_holds_valid_tokenway_configs(rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    _, docs = rendered
    data = one(docs, "ConfigMap", "tokenway-config")["data"]
    assert set(data) == {"gateway.yaml", "policies.yaml"}
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    env = {"TOKENWAY_ADMIN_TOKEN": "t", "POD_NAMESPACE": "tokenway", "UPSTREAM_API_KEY": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = load_settings(tmp_path / "gateway.yaml")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert settings.resolve_path(settings.policies) == tmp_path / "policies.yaml"
    load_config(tmp_path / "policies.yaml")
    assert settings.state.backend == "redis"
    redis_host = settings.state.redis_url.split("//")[1].split(":")[0] if settings.state.redis_url else ""
    one(docs, "Service", redis_host)
    assert settings.server.host == "0.0.0.0"
    assert settings.server.admin_token == "t"  # from the Secret through the environment, not the file
    # every pool finds its endpoints through a Service of this deployment, on a port it names
    for pool in settings.pools:
        assert pool.discovery is not None
        kube = pool.discovery.kubernetes
        service = one(docs, "Service", kube.service or "")
        assert kube.port in {p["name"] for p in service["spec"]["ports"]}
        engines = one(docs, "Deployment", kube.service or "")
        labels = engines["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert SERVICE_NAME_LABEL in kube.selector


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_gateway_probes_and_drain(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    deployment = one(docs, "Deployment", "tokenway-gateway")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["port"] in port_names
    settings = yaml.safe_load(one(docs, "ConfigMap", "tokenway-config")["data"]["gateway.yaml"])
    assert port_names["http"] == settings["server"]["port"]
    # the pod outlives the gateway's own drain (plus the preStop pause)
    assert pod["terminationGracePeriodSeconds"] > settings["server"]["drain_timeout_s"] + 5
    assert pod["serviceAccountName"] == "tokenway-gateway"
    assert container["args"][:3] == ["serve", "--config", "/etc/tokenway/gateway.yaml"]


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_config_is_mounted_as_a_directory(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """A subPath mount never sees ConfigMap updates; the directory mount's `..data` swap is what
    the policy watch follows (tests/deploy/test_k8s_reload.py)."""
    _, docs = rendered
    pod = one(docs, "Deployment", "tokenway-gateway")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_mounts = [m for name, m in mounts.items() if "configMap" in volumes[name]]
    assert [m["mountPath"] for m in config_mounts] == ["/etc/tokenway"]
    assert all("subPath" not in m for m in config_mounts)
    assert volumes[config_mounts[0]["name"]]["configMap"]["name"] == "tokenway-config"


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_secrets_reach_the_gateway_through_its_environment(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    secret = one(docs, "Secret", "tokenway-secrets")
    container = one(docs, "Deployment", "tokenway-gateway")["spec"]["template"]["spec"]["containers"][0]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs["TOKENWAY_ADMIN_TOKEN"] == {"name": "tokenway-secrets", "key": "admin-token"}
    for ref in refs.values():
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert "admin-token" not in one(docs, "ConfigMap", "tokenway-config")["data"]["gateway.yaml"]


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_selectors_select(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    deployment = one(docs, "Deployment", "tokenway-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "Service"):
        obj = one(docs, kind, "tokenway-gateway")
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector and all(pod_labels.get(k) == v for k, v in selector.items()), kind
    pdb = one(docs, "PodDisruptionBudget", "tokenway-gateway")["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler", "tokenway-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tokenway-gateway"}
    assert hpa["minReplicas"] > pdb["maxUnavailable"]  # a drain never takes the last replica
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # every container requests CPU: the HPA's utilisation target is relative to it
    assert "cpu" in deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_rbac_grants_what_discovery_needs_and_no_more(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    role = one(docs, "Role", "tokenway-discovery")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    binding = one(docs, "RoleBinding", "tokenway-discovery")
    assert binding["roleRef"]["name"] == "tokenway-discovery"
    namespace = one(docs, "Deployment", "tokenway-gateway")["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tokenway-gateway", "namespace": namespace}]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


@pytest.mark.e2e  # runs `kubectl kustomize`
def test_vllm_overlay_asks_for_a_gpu_and_waits_for_the_load() -> None:
    docs = kustomize(K8S / "overlays" / "vllm-gpu")
    pod = one(docs, "Deployment", "tokenway-engines")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200  # vLLM's own start deadline
    settings = yaml.safe_load(one(docs, "ConfigMap", "tokenway-config")["data"]["gateway.yaml"])
    pool = settings["pools"][0]
    assert pool["engine"] == "vllm"
    args = container["args"]
    assert args[args.index("--served-model-name") + 1] == pool["served_model_name"]
    assert args[args.index("--block-size") + 1] == str(pool["block_size"])
    assert f"tcp://*:{pool['discovery']['kubernetes']['kv_events_port']}" in args[args.index("--kv-events-config") + 1]


def test_optional_engine_hpa_on_the_desired_replicas_metric_is_valid() -> None:
    """The commented-out HPA of gateway-hpa.yaml stays valid for when it is switched on."""
    text = (K8S / "base" / "gateway-hpa.yaml").read_text()
    commented = text.split("# ---\n", 1)[1]
    doc = yaml.safe_load("\n".join(line[2:] for line in commented.splitlines() if line.startswith("# ")))
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert doc["spec"]["metrics"][0]["external"]["metric"]["name"] == "tokenway_pool_desired_replicas"


def test_engine_images_are_pinned_in_every_overlay() -> None:
    """An engine image by a moving tag (`latest`, or none) changes under a running deployment at the
    next pull; the overlays name a release. tokenway's own image is the one built from this tree."""
    images: list[tuple[Path, str]] = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (((doc or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            containers = [*spec.get("containers", ()), *spec.get("initContainers", ())]
            images.extend((path.relative_to(K8S), container["image"]) for container in containers)
    engines = [(where, image) for where, image in images if not image.startswith("tokenway:")]
    assert any("vllm" in image for _, image in engines), images
    for where, image in engines:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"{where}: {image} is not pinned to a release"


def test_the_demo_key_is_the_one_make_run_prints() -> None:
    import hashlib

    from gateway.app.server import DEMO_KEY

    digest = hashlib.sha256(DEMO_KEY.encode()).hexdigest()
    policies = yaml.safe_load((K8S / "base" / "config" / "policies.yaml").read_text())
    assert digest in {key["sha256"] for key in policies["keys"]}
    assert load_config(K8S / "base" / "config" / "policies.yaml").models["llama-3.1-8b"].aliases == ["gpt-4o-mini"]
