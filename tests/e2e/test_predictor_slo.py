"""Predicted latency and SLOs through real gateway processes, simulated engines and the openai client.

- the analytic prior serves until a model exists; then a model trained off the event loop is
  swapped in and the predictions change; a saved model is loaded at restart;
- routing prefers the endpoint with predicted headroom;
- with an SLO no endpoint can meet, `on_miss` fallback / queue / reject each do what they say, and
  sheddable callers are shed first;
- malformed SLO headers are a 400.

How "no endpoint can meet" is made deterministic: the llama engine runs with `--max-num-seqs 1`
(and the pool says so, for the prior), so while one request occupies its only batch slot a new
request's predicted TTFT includes waiting for that slot (the prior assumes half the new request's
own output is left to run), far over the objective, while an idle engine meets it easily. The
engines run at time scale 2 and the predictor's prior is told so. No model is trained in those
tests (default min_samples) and the correction from recent first tokens is off (predictor/service.py;
the first test turns it on), so every decision is the prior's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from policies.policy import hash_key
from tests.support.procs import (
    OTHER_KEY,
    TEST_KEY,
    Gateway,
    SimEngines,
    http_get,
    metric_total,
    running,
    start_gateway,
    start_sim,
    static_pool,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-7b"
TIME_SCALE = 2.0
SHED_KEY = "sk-tokenway-test-shed"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngines]]:
    workdir = tmp_path_factory.mktemp("predictor-slo-engines")
    narrow = start_sim(workdir, count=1, served_model_name=LLAMA, time_scale=TIME_SCALE, args=["--max-num-seqs", "1"])
    qwen = start_sim(workdir, count=1, served_model_name=QWEN, preset="qwen2.5-7b@h100", time_scale=TIME_SCALE)
    pair = start_sim(workdir, count=2, served_model_name=LLAMA, time_scale=TIME_SCALE)
    with running(narrow, qwen, pair):
        yield {"narrow": narrow, "qwen": qwen, "pair": pair}


def policies(on_miss: str, **slo: Any) -> dict[str, Any]:
    """Tenant `t1` (TEST_KEY) runs under class `fast`; `t2` (OTHER_KEY) has no SLO; `bulk` is sheddable."""
    return {
        "tenants": {"t1": {"slo_class": "fast"}, "t2": {}, "bulk": {"priority": "sheddable", "slo_class": "fast"}},
        "keys": [
            {"id": "k1", "tenant": "t1", "sha256": hash_key(TEST_KEY)},
            {"id": "k2", "tenant": "t2", "sha256": hash_key(OTHER_KEY)},
            {"id": "k3", "tenant": "bulk", "sha256": hash_key(SHED_KEY)},
        ],
        "models": {
            LLAMA: {"fallbacks": [{"model": QWEN, "triggers": ["slo_unattainable"]}]},
            QWEN: {},
        },
        "slo_classes": {"fast": {"ttft_ms": 100, "on_miss": on_miss, **slo}},
    }


def gateway(workdir: Path, pools: list[dict[str, Any]], policy: dict[str, Any], **sections: Any) -> Gateway:
    predictor = {
        "worker": "thread",
        "prior": {"time_scale": TIME_SCALE},
        "advanced": {"recent_ttft_window_s": 0},
        **sections.pop("predictor", {}),
    }
    return start_gateway(
        workdir,
        pools=pools,
        policies=policy,
        predictor=predictor,
        backends={"scrape_interval_s": 0.05},
        ledger={"enabled": False},
        **sections,
    )


def narrow_pools(engines: dict[str, SimEngines]) -> list[dict[str, Any]]:
    return [
        static_pool("llama", LLAMA, engines["narrow"].urls, max_num_seqs=1),
        static_pool("qwen", QWEN, engines["qwen"].urls, preset="qwen2.5-7b@h100"),
    ]


def client(gw: Gateway, key: str = TEST_KEY, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=max_retries, timeout=60)


def chat(
    gw: Gateway, key: str = TEST_KEY, *, max_retries: int = 0, headers: dict[str, str] | None = None, **extra: Any
) -> Any:
    return client(gw, key, max_retries).chat.completions.with_raw_response.create(
        model=extra.pop("model", LLAMA),
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=extra.pop("max_tokens", 128),
        extra_headers={"x-tokenway-debug": "1", **(headers or {})},
        **extra,
    )


def stream(gw: Gateway, key: str = OTHER_KEY, max_tokens: int = 16, **extra: Any) -> Any:
    """A streamed request (the predictor learns from streams); its raw response, fully consumed."""
    response = client(gw, key).chat.completions.with_raw_response.create(
        model=LLAMA,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stream=True,
        extra_headers={"x-tokenway-debug": "1"},
        extra_body={"ignore_eos": True},
        **extra,
    )
    assert list(response.parse())  # consumed to the end: the gateway observes TTFT and TPOT
    return response


def prediction(response: Any) -> dict[str, str]:
    """`x-tokenway-prediction: ttft=..;ttft_p90=..;...;source=..;version=..` as a dict."""
    header = response.headers["x-tokenway-prediction"]
    return dict(part.split("=", 1) for part in header.split(";"))


def predictor_status(gw: Gateway) -> dict[str, Any]:
    status, text = http_get(gw.url + "/admin/predictor")
    assert status == 200, text
    return orjson.loads(text)  # type: ignore[no-any-return]


def wait_scraped_running(gw: Gateway, url: str, ok: Callable[[int], bool], timeout_s: float = 60.0) -> None:
    """Until the gateway's last scrape of the engine at `url` shows a number of running requests that
    is `ok` (a fixed sleep is too short on a loaded machine: prompts still prefilling, not yet scraped;
    and a scrape taken during the previous request shows it running after it ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = http_get(gw.url + "/admin/backends")
        assert status == 200, text
        running_now = [e["running"] for p in orjson.loads(text)["pools"] for e in p["endpoints"] if e["url"] == url]
        if running_now and ok(running_now[0]):
            return
        assert time.monotonic() < deadline, f"{url} runs {running_now}"
        time.sleep(0.05)


class Occupier:
    """One long streamed request holding the narrow engine's only batch slot, through `gw` (so the
    gateway's in-flight accounting sees it at once)."""

    def __init__(self, gw: Gateway, max_tokens: int = 900, settle_s: float = 0.3) -> None:
        self._thread = threading.Thread(target=stream, args=(gw, OTHER_KEY, max_tokens), daemon=True)
        self._settle_s = settle_s

    def __enter__(self) -> Occupier:
        self._thread.start()
        time.sleep(self._settle_s)  # dispatched and scraped as running
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(60)
        time.sleep(0.2)  # the next scrape shows the engine idle again


def warm(gw: Gateway) -> None:
    """The gateway's first request pays one-off costs (tokenizer load) that count against a TTFT SLO."""
    stream(gw, OTHER_KEY, max_tokens=2)
    time.sleep(0.2)


# --- the predictor ------------------------------------------------------------------------------------


def test_prior_first_then_a_model_trained_off_loop_is_swapped_in_and_loaded_after_restart(
    tmp_path: Path, engines: dict[str, SimEngines]
) -> None:
    settings = {
        "min_samples": 10,
        "retrain_min_new_samples": 10,
        "retrain_interval_s": 0.2,
        "model_dir": str(tmp_path / "models"),
        "advanced": {"recent_ttft_window_s": 3600},
    }
    pools = [static_pool("llama", LLAMA, engines["pair"].urls)]
    gw = gateway(tmp_path / "gw1", pools, policies("reject"), predictor=settings)
    with running(gw):
        first = stream(gw)
        assert prediction(first)["source"] == "prior"
        status = predictor_status(gw)["pools"]["llama"]
        assert status["targets"]["ttft"]["source"] == "prior" and status["model_version"] == 0
        prior_ttft = float(prediction(first)["ttft"])
        with ThreadPoolExecutor(4) as pool:  # varied load and lengths: something to learn
            list(pool.map(lambda i: stream(gw, max_tokens=4 + 7 * (i % 5)), range(40)))
        deadline = time.monotonic() + 30
        while predictor_status(gw)["pools"]["llama"]["targets"]["ttft"]["source"] != "model":
            assert time.monotonic() < deadline, predictor_status(gw)
            stream(gw)
        time.sleep(0.3)
        later = stream(gw)
        after = prediction(later)
        assert float(after["ttft"]) != pytest.approx(prior_ttft, rel=1e-3)  # the model, not the prior, answered
        status = predictor_status(gw)["pools"]["llama"]
        assert after["source"] == "model" and int(after["version"]) == status["model_version"] > 0
        assert status["trainings"] >= status["model_version"]  # every version came from a training
        assert status["targets"]["ttft"]["model_age_s"] >= 0
        assert status["targets"]["ttft"]["online"]["mape_pct"] is not None
        version = status["model_version"]
        metrics = http_get(gw.url + "/metrics")[1]  # the same accuracy as Prometheus gauges, per pool and target
        for target in ("ttft", "tpot"):
            for field in ("samples", "mape_ratio", "p90_coverage_ratio", "model_age_seconds"):
                assert f'tokenway_predictor_{target}_{field}{{pool="llama"}}' in metrics, (target, field)
        code, text = http_get(gw.url + "/admin/predictor/samples?pool=llama")  # the outcomes, in time order
        assert code == 200, text
        outcomes = orjson.loads(text)["pools"]["llama"]
        assert len(outcomes) >= 40
        assert [o["observed_at_s"] for o in outcomes] == sorted(o["observed_at_s"] for o in outcomes)
        last = outcomes[-1]
        assert last["endpoint"] in engines["pair"].urls or last["endpoint"].startswith("llama/")
        assert last["predicted_at_s"] <= last["observed_at_s"] and last["ttft_ms"] > 0
        assert last["features"]["input_tokens"] > 0 and last["predicted"]["model_version"] == version
        # streamed first tokens, relayed, corrected the TTFT predictions made after them
        assert status["ttft_recent_factor"] != 1.0 and outcomes[-1]["predicted"]["ttft_factor"] != 1.0
        assert outcomes[0]["predicted"]["ttft_factor"] == 1.0  # nothing relayed before the first
    assert list((tmp_path / "models").rglob("*")), "the model was saved"

    restarted = gateway(tmp_path / "gw2", pools, policies("reject"), predictor=settings)
    with running(restarted):
        status = predictor_status(restarted)["pools"]["llama"]
        assert status["model_version"] == version and status["targets"]["ttft"]["source"] == "model"
        assert status["trainings"] == 0  # loaded, not retrained
        again = prediction(stream(restarted))
        assert again["source"] == "model" and int(again["version"]) == version


# --- routing ------------------------------------------------------------------------------------------


def test_routing_prefers_the_endpoint_with_predicted_headroom(tmp_path: Path, engines: dict[str, SimEngines]) -> None:
    pair = engines["pair"]
    pools = [static_pool("llama", LLAMA, pair.urls)]
    latency_only = {"default": {"filters": [], "scorers": [{"type": "latency"}], "picker": {"type": "max-score"}}}
    gw = gateway(tmp_path / "gw", pools, policies("reject"), routing=latency_only)
    busy_url, idle_url = pair.urls[0], pair.urls[1]
    direct = openai.OpenAI(base_url=busy_url + "/v1", api_key="x", max_retries=0)
    long_prompt = [{"role": "user", "content": "lorem ipsum dolor " * 700}]

    def load(i: int) -> None:  # straight to the engine: the gateway sees it only in scraped metrics
        chunks = direct.chat.completions.create(
            model=LLAMA,
            messages=long_prompt,  # type: ignore[arg-type]
            max_tokens=1200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert list(chunks)  # the whole generation ran on the engine

    with running(gw), ThreadPoolExecutor(24) as pool:
        warm(gw)
        loads = [pool.submit(load, i) for i in range(24)]
        wait_scraped_running(gw, busy_url, lambda n: n >= 24)

        def routed(headers: dict[str, str] | None = None) -> Any:
            # the idle engine's last scrape must not still show the previous request running there
            wait_scraped_running(gw, idle_url, lambda n: n == 0)
            return chat(gw, OTHER_KEY, headers=headers).headers

        plain = [routed() for _ in range(4)]
        tight = {"x-slo-ttft-ms": "25", "x-slo-tpot-ms": "8"}
        slo = [routed(tight) for _ in range(4)]
        for future in loads:
            future.result()
    served = [h["x-tokenway-endpoint"] for h in plain]
    with_slo = [h["x-tokenway-endpoint"] for h in slo]
    why = [h.get("x-tokenway-route") for h in plain + slo]
    assert served == ["llama/both-s1"] * 4, why  # the idle one: lower predicted latency
    # a tight SLO: the loaded endpoint's predicted TPOT (a long-context batch of 24) misses 8 ms
    assert with_slo == ["llama/both-s1"] * 4, why


# --- SLO misses ---------------------------------------------------------------------------------------


def test_on_miss_fallback_serves_the_fallback_model(tmp_path: Path, engines: dict[str, SimEngines]) -> None:
    gw = gateway(tmp_path / "gw", narrow_pools(engines), policies("fallback"))
    with running(gw):
        warm(gw)
        idle = chat(gw)
        assert idle.parse().model == LLAMA and idle.headers.get("x-tokenway-fallback") is None
        with Occupier(gw):
            response = chat(gw)
        assert response.parse().model == QWEN
        assert response.headers["x-tokenway-fallback"] == f"{LLAMA}->{QWEN};reason=slo_unattainable"
        assert response.headers["x-tokenway-model"] == QWEN


def test_on_miss_queue_waits_for_capacity_then_serves_or_times_out(
    tmp_path: Path, engines: dict[str, SimEngines]
) -> None:
    # the occupier has ~100 tokens (~0.35 s) left; the prior, not knowing, expects half of the new
    # request's 800 (~1.4 s, p90 more) before the slot frees: over 1 s, so it queues, and the
    # occupier ending wakes it well within its TTFT objective
    gw = gateway(tmp_path / "gw", narrow_pools(engines), policies("queue", max_queue_ms=5000, ttft_ms=1000))
    with running(gw):
        warm(gw)
        with Occupier(gw, max_tokens=150, settle_s=0.15):
            response = chat(gw, max_tokens=800)
        assert response.parse().model == LLAMA and response.headers.get("x-tokenway-fallback") is None
        assert float(response.headers["x-tokenway-queued-ms"]) > 0  # it waited, then ran where it was sent
    gw_short = gateway(tmp_path / "gw-short", narrow_pools(engines), policies("queue", max_queue_ms=300))
    with running(gw_short):
        warm(gw_short)
        with Occupier(gw_short), pytest.raises(openai.InternalServerError) as info:
            chat(gw_short)
        assert info.value.status_code == 503 and info.value.code == "slo_unattainable"
        assert "Waited" in info.value.message and info.value.response.headers["retry-after"].isdigit()


def test_on_miss_reject_is_an_early_503_with_retry_after_and_sheddable_is_shed(
    tmp_path: Path, engines: dict[str, SimEngines]
) -> None:
    gw = gateway(tmp_path / "gw", narrow_pools(engines), policies("reject"))
    engine = engines["narrow"].urls[0]
    with running(gw):
        warm(gw)
        assert chat(gw).parse().model == LLAMA  # idle: it meets the SLO
        served_before = metric_total(engine, "vllm:request_success_total")
        with Occupier(gw, max_tokens=1500):  # still running when the client retries after retry-after
            with pytest.raises(openai.InternalServerError) as info:
                chat(gw)
            with pytest.raises(openai.InternalServerError):
                chat(gw, max_retries=1)  # the client honours retry-after once, then gives up
            with pytest.raises(openai.InternalServerError) as shed:
                chat(gw, SHED_KEY)
        error = info.value
        assert (error.status_code, error.code, error.type) == (503, "slo_unattainable", "server_error")
        retry_s = int(error.response.headers["retry-after"])
        assert 1 <= retry_s <= 60 and error.response.headers["retry-after-ms"] == str(retry_s * 1000)  # floor, cap
        assert shed.value.code == "slo_unattainable" and "Shed: sheddable" in shed.value.message
        # early: none of the four rejected attempts reached the engine; only the occupier ran there
        assert metric_total(engine, "vllm:request_success_total") - served_before == 1
        admission = {"model": LLAMA, "outcome": "rejected", "reason": "slo_unattainable"}
        assert metric_total(gw.url, "tokenway_admission_total", tenant="t1", **admission) == 3  # 1 + 1 retried
        assert metric_total(gw.url, "tokenway_admission_total", tenant="bulk", outcome="shed") == 1


def test_malformed_slo_headers_are_a_400(tmp_path: Path, engines: dict[str, SimEngines]) -> None:
    gw = gateway(tmp_path / "gw", narrow_pools(engines), policies("reject"))
    cases = [("x-slo-ttft-ms", "fast"), ("x-slo-ttft-ms", "-1"), ("x-slo-tpot-ms", "0"), ("x-slo-tpot-ms", "nan")]
    with running(gw):
        for header, value in cases:
            with pytest.raises(openai.BadRequestError) as info:
                chat(gw, OTHER_KEY, max_retries=2, headers={header: value})  # a 400 is never retried
            body = info.value.body
            assert isinstance(body, dict) and body["param"] == header and body["type"] == "invalid_request_error"
        assert chat(gw, OTHER_KEY, headers={"x-slo-ttft-ms": "5000"}).parse().model == LLAMA
