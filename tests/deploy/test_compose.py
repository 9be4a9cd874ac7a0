"""docker-compose.yml matches the project: every file it mounts exists and parses, commands are real
`tokenway` subcommands with real flags, and ports, hosts and paths agree between the compose file,
gateway.yaml, Prometheus, the OpenTelemetry collector and Grafana. No Docker needed."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.app.cli import build_parser
from gateway.app.settings import GatewaySettings, load_settings
from gateway.request.record import RequestRecord
from gateway.telemetry.metrics import GatewayMetrics
from policies.loader import load_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
GATEWAY_CONFIG_IN_CONTAINER = "/etc/tokenway/gateway.yaml"
# short volume syntax SOURCE:TARGET[:MODE]; SOURCE may hold ${VAR:-default}
_VOLUME_RE = re.compile(r"^(?P<source>.+?):(?P<target>/[^:]*)(?::(?P<mode>[a-z,]+))?$")


def mounts(service: str) -> dict[str, str]:
    """Container path -> host source (relative to the repo) of a service's bind mounts and volumes."""
    out = {}
    for spec in SERVICES[service].get("volumes", []):
        m = _VOLUME_RE.match(spec)
        assert m, f"{service}: cannot read volume {spec!r}"
        out[m["target"]] = m["source"]
    return out


def host_file(service: str, container_path: str) -> Path:
    """The repo file a service sees at `container_path` (a bind mount of it or of a parent folder)."""
    path = PurePosixPath(container_path)
    for target, source in mounts(service).items():
        if source.startswith("./"):
            try:
                relative = path.relative_to(target)
            except ValueError:
                continue
            return REPO / source / relative
    raise AssertionError(f"{service}: nothing mounted at {container_path}")


def published(service: str) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for spec in SERVICES[service].get("ports", []):
        host, container = str(spec).rsplit(":", 1)[-2:] if ":" in str(spec) else (spec, spec)
        out[int(container)] = int(str(host).rsplit(":", 1)[-1])
    return out


def option(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


@pytest.fixture(scope="module")
def settings() -> GatewaySettings:
    argv = SERVICES["gateway"]["command"]
    config = option(argv, "--config")
    assert config == GATEWAY_CONFIG_IN_CONTAINER
    return load_settings(host_file("gateway", config))


def test_services_and_profiles() -> None:
    assert {"gateway", "sim", "vllm", "redis", "prometheus", "grafana", "otel-collector"} <= set(SERVICES)
    assert SERVICES["vllm"]["profiles"] == ["gpu"]
    for name, service in SERVICES.items():
        if name != "vllm":
            assert "profiles" not in service, f"{name} must run in the default (simulated) stack"
    devices = SERVICES["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_every_mounted_file_exists_and_named_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes") or {})
    for name in SERVICES:
        for target, source in mounts(name).items():
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name}: {source} (mounted at {target}) does not exist"
            elif not source.startswith(("/", "~", "$")):
                assert source in declared, f"{name}: volume {source} is not declared"
        build = SERVICES[name].get("build")
        if build:
            assert (REPO / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
        for dep in SERVICES[name].get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"


def test_dockerfile_builds_the_cli_image() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r'^ENTRYPOINT \["tokenway"\]', text, re.M)
    assert 'pip install ".[plot,k8s,epp]"' in text  # the Kubernetes image discovers engines and serves EPP
    assert re.search(r"^EXPOSE 8080\b", text, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'tokenway = "gateway.app.cli:main"' in pyproject, "the entrypoint is the project's console script"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    for package in ("gateway", "policies", "predictor", "backends"):
        assert package not in ignored


def test_gateway_command_config_and_ports(settings: GatewaySettings) -> None:
    build_parser().parse_args(SERVICES["gateway"]["command"])  # a real subcommand with real flags
    assert settings.server.host == "0.0.0.0", "reachable from the other containers"
    assert published("gateway") == {settings.server.port: 8080}
    policies = PurePosixPath(GATEWAY_CONFIG_IN_CONTAINER).parent / settings.policies
    load_config(host_file("gateway", str(policies)))  # mounted where gateway.yaml points, and valid
    assert settings.resolve_path(settings.policies).resolve() == host_file("gateway", str(policies)).resolve()


def test_state_and_ledger(settings: GatewaySettings) -> None:
    assert settings.state.backend == "redis"
    assert urlsplit(settings.state.redis_url or "").hostname == "redis"
    ledger = settings.ledger
    assert any(
        PurePosixPath(ledger.dir).is_relative_to(target) and not source.startswith("./")
        for target, source in mounts("gateway").items()
    ), "the ledger lives on a volume"
    assert ledger.redis_stream is not None and urlsplit(ledger.redis_stream.url).hostname == "redis"


def test_sim_command_serves_the_sim_pool(settings: GatewaySettings) -> None:
    from sim.server import _parser

    argv = SERVICES["sim"]["command"]
    assert argv[0] == "sim"
    args, unknown = _parser().parse_known_args(argv[1:])
    assert unknown == []
    assert args.host == "0.0.0.0"
    pool = next(p for p in settings.pools if p.engine == "sim")
    served = {f"http://sim:{args.port + i}" for i in range(args.instances)}
    assert {e.url for e in pool.endpoints} == served
    assert args.served_model_name == [pool.upstream_model]


def test_vllm_serves_the_gpu_pool(settings: GatewaySettings) -> None:
    argv = SERVICES["vllm"]["command"]
    pool = next(p for p in settings.pools if p.engine == "vllm")
    assert [e.url for e in pool.endpoints] == [f"http://vllm:{option(argv, '--port')}"]
    assert option(argv, "--model") == pool.upstream_model
    assert option(argv, "--host") == "0.0.0.0"


def test_otlp_goes_to_the_collector(settings: GatewaySettings) -> None:
    telemetry = settings.telemetry
    endpoint = urlsplit(telemetry.otlp.endpoint or "")
    assert endpoint.hostname == "otel-collector"
    config_path = option(SERVICES["otel-collector"]["command"], "--config")
    collector = yaml.safe_load(host_file("otel-collector", config_path).read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert int(http.rsplit(":", 1)[1]) == endpoint.port
    for pipeline in collector["service"]["pipelines"].values():
        for name in pipeline["receivers"] + pipeline.get("processors", []):
            assert name in {**collector["receivers"], **collector.get("processors", {})}
        for name in pipeline["exporters"]:
            assert name in collector["exporters"]
    jaeger = urlsplit("//" + collector["exporters"]["otlp/jaeger"]["endpoint"]).hostname
    assert jaeger in SERVICES


def test_prometheus_scrapes_the_gateway(settings: GatewaySettings) -> None:
    argv = SERVICES["prometheus"]["command"]
    config = yaml.safe_load(host_file("prometheus", option(argv, "--config.file")).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway = jobs["tokenway"]
    assert gateway.get("metrics_path", "/metrics") == "/metrics"
    assert gateway["static_configs"][0]["targets"] == [f"gateway:{settings.server.port}"]
    for job in jobs.values():
        for target in job["static_configs"][0]["targets"]:
            assert target.split(":")[0] in SERVICES, f"{job['job_name']}: unknown host in {target}"
    sim_targets = set(jobs["sim"]["static_configs"][0]["targets"])
    sim_pools = [p for p in settings.pools if p.engine == "sim"]
    assert sim_targets == {e.url.removeprefix("http://") for pool in sim_pools for e in pool.endpoints}


def test_grafana_provisioning() -> None:
    datasources = yaml.safe_load(
        host_file("grafana", "/etc/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    prometheus = datasources["datasources"][0]
    assert urlsplit(prometheus["url"]).hostname == "prometheus"
    assert urlsplit(prometheus["url"]).port in published("prometheus")
    providers = yaml.safe_load(host_file("grafana", "/etc/grafana/provisioning/dashboards/tokenway.yaml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    dashboard_file = host_file("grafana", f"{folder}/tokenway.json")
    dashboard = json.loads(dashboard_file.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {prometheus["uid"]}
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_file("grafana", home) == dashboard_file


def test_dashboard_is_generated_from_build_dashboard() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "deploy/grafana/build_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "deploy/grafana/dashboards/tokenway.json").read_text() == module.render(), (
        "run: python deploy/grafana/build_dashboard.py"
    )


# Families the dashboard may leave out, each with its reason (everything else must be on it).
NOT_ON_DASHBOARD: dict[str, str] = {}
_FAMILY_RE = re.compile(
    r"\b(CounterFamily|HistogramFamily|GaugeMetricFamily|CounterMetricFamily|HistogramMetricFamily)\(\s*"
    r"\"((?:tokenway|gen_ai)_[a-z0-9_]+)\""
)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_families() -> dict[str, tuple[str, ...]]:
    """Every metric family the gateway exports -> the sample names it shows: the per-request and
    state families of a GatewayMetrics (predictor gauges from a full status), every family another
    collector declares in gateway/ (flow control, batch, elastic pools), and the endpoint families
    (they exist once there are endpoints)."""
    from gateway.http.admin import predictor_gauges

    metrics = GatewayMetrics()
    metrics.observe(
        RequestRecord(
            request_id="r", api="chat", started_at_unix_s=time.time(), tenant="t", model="m", pool="p",
            endpoint="p/both-0", engine="sim", usage_source="engine", ttft_s=0.1, tpot_s=0.01,
        )
    )  # fmt: skip
    metrics.set_endpoint_gauges([])
    metrics.set_limiter_gauges([{"scope": "tenant", "id": "t", "dimension": "usd_per_day", "limit": 1, "remaining": 1}])
    metrics.set_ledger_stats(lambda: {"written_total": 0, "pending_records": 0, "dropped_total": 0})
    target = {"source": "model", "samples": 9, "model_age_s": 1.0, "online": {"mape_pct": 12.0, "p90_coverage": 0.9}}
    status = {"pools": {"p": {"model_version": 1, "targets": {"ttft": target, "tpot": target}}}}
    metrics.set_predictor_gauges(lambda: predictor_gauges(status))
    families: dict[str, tuple[str, ...]] = {}
    for family in metrics.registry.collect():
        families[family.name] = tuple(family.name + x for x in _SUFFIXES.get(family.type, ("",)))
    for path in (REPO / "gateway").rglob("*.py"):
        for kind, name in _FAMILY_RE.findall(path.read_text()):
            if kind == "CounterMetricFamily":
                families[name] = (name + "_total",)
            elif kind.startswith("Histogram"):
                families[name] = tuple(name + x for x in _SUFFIXES["histogram"])
            else:
                families[name] = (name,)
    for n in (
        "state",
        "running_requests",
        "waiting_requests",
        "kv_usage_ratio",
        "inflight_requests",
        "inflight_prefill_tokens",
        "inflight_decode_tokens",
        "stats_age_seconds",
        "consecutive_failures",
    ):
        families[f"tokenway_endpoint_{n}"] = (f"tokenway_endpoint_{n}",)
    for n in ("prefix_cache_hits_tokens", "prefix_cache_queries_tokens", "restarts"):
        families[f"tokenway_endpoint_{n}"] = (f"tokenway_endpoint_{n}_total",)
    return families  # fmt: skip


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/tokenway.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    # metric names, not label names: drop `by (...)` lists and `label="..."` matchers first
    bare = [re.sub(r"\bby \([^)]*\)|\b[a-z_]+\s*(?:=~|!=|!~|=)\s*\"[^\"]*\"", "", e) for e in exprs]
    return {m for e in bare for m in re.findall(r"\b((?:tokenway|gen_ai)_[a-z0-9_]+)", e)}


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = {name for names in exported_families().values() for name in names}
    queried = dashboard_metrics()
    assert queried, "no metric found in the dashboard"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_every_exported_family_is_on_the_dashboard() -> None:
    """A family the gateway exports and the dashboard never shows is one an operator cannot see;
    a new family fails here until it has a panel (deploy/grafana/build_dashboard.py) or a reason in
    NOT_ON_DASHBOARD."""
    queried = dashboard_metrics()
    families = exported_families()
    assert len(families) >= 70, sorted(families)  # the collectors were all found
    missing = sorted(f for f, names in families.items() if f not in NOT_ON_DASHBOARD and not set(names) & queried)
    assert missing == [], f"exported but on no panel: {missing}"


def test_the_image_ships_a_default_config_that_runs_with_an_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.http.access import exposure_problem

    text = (REPO / "Dockerfile").read_text()
    copied = re.search(r"cp (\S+) (\S+) /etc/tokenway/", text)
    assert copied, "the image copies a gateway.yaml and a policies.yaml into /etc/tokenway"
    command = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    build_parser().parse_args(command)
    assert command[command.index("--config") + 1] == "/etc/tokenway/gateway.yaml"
    monkeypatch.setenv("TOKENWAY_ADMIN_TOKEN", "a-random-admin-token-0f3e9c")
    settings = load_settings(REPO / copied[1])
    assert (
        settings.server.host == "0.0.0.0"
        and exposure_problem(settings.server.host, settings.server.admin_token) is None
    )
    assert (REPO / copied[2]).name == settings.policies  # the policies file lands next to it, where it points
    load_config(REPO / copied[2])
    assert settings.pools and all(p.engine == "sim" for p in settings.pools)  # nothing else to install
    assert settings.pools == load_settings(REPO / "config" / "gateway.yaml").pools  # `make run`'s, not a drifting copy


def test_the_demo_key_and_model_names_are_those_of_make_run(settings: GatewaySettings) -> None:
    """A snippet written against `make run` (config/gateway.yaml + policies.yaml: the banner's key,
    its models and aliases) works unchanged against `docker compose up`'s default profile."""
    import hashlib

    from gateway.app.server import DEMO_KEY

    make_run = load_settings(REPO / "config" / "gateway.yaml")
    run_policies = load_config(make_run.resolve_path(make_run.policies))
    compose_policies = load_config(
        host_file("gateway", str(PurePosixPath(GATEWAY_CONFIG_IN_CONTAINER).parent / settings.policies))
    )
    digest = hashlib.sha256(DEMO_KEY.encode()).hexdigest()
    assert digest in {key.sha256 for key in run_policies.keys}
    assert digest in {key.sha256 for key in compose_policies.keys}, "compose accepts the make run demo key"
    run_models = {pool.model for pool in make_run.pools}
    compose_models = {pool.model for pool in settings.pools if pool.engine == "sim"}  # the default profile
    assert run_models == compose_models
    for model in run_models:
        assert compose_policies.models[model].aliases == run_policies.models[model].aliases, model
        assert [f.model for f in compose_policies.models[model].fallbacks] == [
            f.model for f in run_policies.models[model].fallbacks
        ], model


def test_every_sim_service_serves_its_pool(settings: GatewaySettings) -> None:
    from sim.server import _parser

    served: dict[str, str] = {}
    for name, service in SERVICES.items():
        argv = service.get("command") or []
        if argv[:1] == ["sim"]:
            args, unknown = _parser().parse_known_args(argv[1:])
            assert unknown == [] and args.host == "0.0.0.0", name
            for i in range(args.instances):
                served[f"http://{name}:{args.port + i}"] = args.served_model_name[0]
    for pool in (p for p in settings.pools if p.engine == "sim"):
        for endpoint in pool.endpoints:
            assert served.get(endpoint.url) == pool.upstream_model, endpoint.url
    scraped = yaml.safe_load(host_file("prometheus", "/etc/prometheus/prometheus.yml").read_text())
    targets = {t for job in scraped["scrape_configs"] for c in job.get("static_configs", ()) for t in c["targets"]}
    assert {url.removeprefix("http://") for url in served} <= targets, "every engine is scraped"
