"""`/metrics` of one simulated engine: vLLM 0.33's names, types, labels and buckets.

Source of names and buckets: vllm/v1/metrics/loggers.py (PrometheusStatLogger). Every engine metric
carries `model_name` (first served name) and `engine` ("0"); counters are exposed with `_total`.
Latencies are simulated seconds. Each instance has its own CollectorRegistry, so many engines can
share a process.

The values are plain Python numbers that one collector turns into prometheus_client families at
scrape time (the same exposition, `_created` samples included, as prometheus_client's own Counter,
Gauge and Histogram): a step costs a few integer additions and one bucket search per distinct value,
not a lock per observation. The state gauges (running, waiting, KV usage) are read from the engine
when scraped.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sim.config import EngineConfig
from sim.scheduler import Request, StepStats

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# vllm:engine_sleep_state's series, by sleep level (vllm/v1/metrics/loggers.py)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# vllm/entrypoints/serve/dev/sleep/metrics.py
SLEEP_OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
OFFLOAD_TRANSFERS = ("GPU_to_CPU", "CPU_to_GPU")  # vLLM's transfer_type: source medium _to_ destination


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histogram buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _Counter:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()


class _Histogram:
    """Bucket counts (not cumulative; the last bucket is +Inf), sum and count of observations."""

    __slots__ = ("bounds", "counts", "created", "le", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = [float(b) for b in buckets]
        if self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self.le: list[str] = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call, unused-ignore]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count if count != 1 else value


class _Family:
    __slots__ = ("doc", "kind", "labels", "name", "series")

    def __init__(self, name: str, doc: str, kind: str, labels: dict[str, str]) -> None:
        self.name, self.doc, self.kind, self.labels = name, doc, kind, labels
        self.series: list[tuple[dict[str, str], _Counter | _Histogram | Callable[[], float]]] = []


class _Collector(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        for family in self.families:
            metric = Metric(family.name, family.doc, family.kind)
            created: list[tuple[dict[str, str], float]] = []
            for extra, value in family.series:
                labels = {**family.labels, **extra}
                if isinstance(value, _Counter):
                    metric.add_sample(family.name + "_total", labels, value.value)
                    created.append((labels, value.created))
                elif isinstance(value, _Histogram):
                    cumulative = 0
                    for le, count in zip(value.le, value.counts, strict=True):
                        cumulative += count
                        metric.add_sample(family.name + "_bucket", {**labels, "le": le}, float(cumulative))
                    metric.add_sample(family.name + "_count", labels, float(cumulative))
                    metric.add_sample(family.name + "_sum", labels, value.sum)
                    created.append((labels, value.created))
                else:  # read when scraped (a counter's too: its engine keeps the count)
                    metric.add_sample(
                        family.name + ("_total" if family.kind == "counter" else ""), labels, float(value())
                    )
            for labels, stamp in created:
                metric.add_sample(family.name + "_created", labels, stamp)
            yield metric


class EngineMetrics:
    def __init__(self, config: EngineConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": config.served_model_name, "engine": "0"}
        families: list[_Family] = []
        self._state = (0, 0, 0.0)
        # Where the state gauges come from at scrape time; set_state's values until the engine sets it.
        self.state_source: Callable[[], tuple[int, int, float]] = lambda: self._state
        # 0 awake, else the sleep level (SleepMode, engine.py); one-hot over SLEEP_STATES at scrape time.
        self.sleep_level_source: Callable[[], int] = lambda: 0

        def gauge(name: str, doc: str, index: int) -> None:
            family = _Family(name, doc, "gauge", labels)
            family.series.append(({}, lambda: self.state_source()[index]))
            families.append(family)

        def counter(name: str, doc: str) -> _Counter:
            family = _Family(name, doc, "counter", labels)
            value = _Counter()
            family.series.append(({}, value))
            families.append(family)
            return value

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> _Histogram:
            family = _Family(name, doc, "histogram", labels)
            value = _Histogram(buckets)
            family.series.append(({}, value))
            families.append(family)
            return value

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", 0)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 1)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", 2)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = _Family("vllm:request_success", "Count of successfully processed requests.", "counter", labels)
        self.success = {reason: _Counter() for reason in FINISH_REASONS}
        success.series.extend(({"finished_reason": reason}, value) for reason, value in self.success.items())
        families.append(success)
        token_buckets = build_1_2_5_buckets(config.max_model_len)
        self.req_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.req_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        cache_info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "hash_block_size": str(config.block_size),
            "kv_cache_size_tokens": str(config.num_gpu_blocks * config.block_size),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "prefix_caching_hash_algo": "xxhash",
        }
        info = _Family(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge", {**cache_info, **labels}
        )
        info.series.append(({}, lambda: 1.0))
        families.append(info)
        sleep_state = _Family(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "gauge",
            labels,
        )
        for level, state in enumerate(SLEEP_STATES):
            sleep_state.series.append(({"sleep_state": state}, self._sleep_state_reader(level)))
        families.append(sleep_state)
        # the host-DRAM tier's traffic, as vLLM's OffloadingConnector exports it (OffloadPromMetrics,
        # vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py): bytes and seconds per
        # transfer type, read from the engine's HostOffload at scrape time (`offload_source`)
        self.offload_source: Callable[[], tuple[float, float, float, float]] = lambda: (0.0, 0.0, 0.0, 0.0)
        if config.kv_offload_blocks:
            for name, doc, first in (
                ("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector", 0),
                ("vllm:kv_offload_total_time", "Total time measured by all KV offloading operations", 2),
            ):
                family = _Family(name, doc, "counter", labels)
                for index, transfer in enumerate(OFFLOAD_TRANSFERS):
                    family.series.append(({"transfer_type": transfer}, self._offload_reader(first + index)))
                families.append(family)
        self.sleep_operations: dict[str, _Histogram] = {}
        if config.enable_sleep_mode and config.server_dev_mode:  # vLLM exports it with the sleep routes
            operations = _Family(
                "vllm:sleep_mode_operation_duration_seconds",
                "Duration of one sleep-mode operation.",
                "histogram",
                labels,
            )
            for operation in ("sleep", "wake"):
                self.sleep_operations[operation] = _Histogram(SLEEP_OPERATION_BUCKETS)
                operations.series.append(({"operation": operation}, self.sleep_operations[operation]))
            families.append(operations)
        self.registry.register(_Collector(families))

    def _offload_reader(self, index: int) -> Callable[[], float]:
        return lambda: self.offload_source()[index]

    def _sleep_state_reader(self, level: int) -> Callable[[], float]:
        return lambda: float(self.sleep_level_source() == level)

    def observe_sleep_operation(self, operation: str, seconds: float) -> None:
        histogram = self.sleep_operations.get(operation)
        if histogram is not None:
            histogram.observe(seconds)

    def record_step(self, stats: StepStats, step_tokens: int) -> None:
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        if stats.prompt_tokens:
            self.prompt_tokens.value += stats.prompt_tokens
        if stats.generation_tokens:
            self.generation_tokens.value += stats.generation_tokens
        if stats.preemptions:
            self.preemptions.value += stats.preemptions
        if stats.prefix_queries:
            self.prefix_queries.value += stats.prefix_queries
        if stats.prefix_hits:
            self.prefix_hits.value += stats.prefix_hits
        for ttft in stats.ttfts:
            self.ttft.observe(ttft)
        observe_itl = self.itl.observe
        for itl, count in stats.itl_counts.items():
            observe_itl(itl, count)
        for req in stats.finished:
            self.record_finished(req)

    def record_finished(self, req: Request) -> None:
        self.success[req.finish_reason or "error"].value += 1
        if req.finish_reason == "abort":
            return
        t = req.timings()
        self.e2e.observe(t["e2e_s"])
        self.queue.observe(t["queue_s"])
        self.prefill.observe(t["prefill_s"])
        self.decode.observe(t["decode_s"])
        self.inference.observe(t["prefill_s"] + t["decode_s"])
        if req.num_output > 1:
            self.tpot.observe(t["tpot_s"])
        self.req_prompt_tokens.observe(req.num_prompt)
        self.req_generation_tokens.observe(req.num_output)
        if not req.pooling:  # vLLM has no max_tokens for a pooling request
            self.req_max_tokens.observe(req.max_tokens)

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        """Fixed gauge values (used until `state_source` is pointed at a live engine)."""
        self._state = (running, waiting, kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
