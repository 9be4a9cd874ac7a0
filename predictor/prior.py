"""What the predictor assumes before its trees have learnt anything: the analytic TTFT/TPOT prior from
the pool's model and hardware, the token velocity of a replica derived from that same prior, and
the output length a request without `max_tokens` is expected to produce.

One module because all three are estimates from first principles or plain statistics, read on the
request path and by the autoscaler without a trained model: the prior is the column the trees
correct, and the output-length estimate is the output-token feature they read.

Latency prior
-------------
Analytic TTFT/TPOT prior from the pool's model and hardware, used before a model exists.

The step-time physics is the roofline the simulated engine runs on (`backends.perf.roofline.step_cost`),
over the same presets, so recalibrating the simulator moves this prior too:

    step_s = max(compute_s, memory_s) + comm_s + overhead_s
    compute_s = k_token·tokens + k_sampled·sequences + k_attention·attention_pairs
    memory_s  = weights_s + k_kv·(kv_read_tokens + tokens)
    comm_s    = comm_base_s + comm_token_s·tokens          (TP > 1)
    overhead_s = step_overhead_s + prefill_overhead_s·[step carries prefill] + sequence_overhead_s·sequences

`Roofline.from_preset` recovers these coefficients by probing `step_cost` at a few points (each part
is affine in the step's aggregates), so the prior uses exactly the sim's quantities as plain float
arithmetic (a few microseconds per candidate) instead of building step descriptions for `step_cost`.

Per candidate, with the engine's limits S = max_num_seqs and B = max_num_batched_tokens (vLLM V1:
running decodes are scheduled first, then waiting prefills FCFS in chunks of the remaining budget):

    D        = decoding batch now = min(S, max(running, inflight_requests - waiting))
    work     = inflight_prefill_tokens + uncached   (prompt tokens prefilled before its first token)
    steps    = ceil(work / max(B - D, 64))
    steady(n)= mean step of n decodes while prompts arrive at the endpoint's recent prefill rate
               (fluid fixed point, see `_steady_step_s`; a plain decode step when the rate is 0)
    TTFT     = frontend                                                    API server, both ways
             + steps · step(work/steps prefill tokens + D decodes)          chunked prefill
             + max(0, steady(D) - since_last_token)  (else steady(D)/2)    the step in progress
             + excess · output / (2·D) · step(D decodes)                    waiting for a batch slot
               where excess = max(0, D + waiting + 1 - S)
    TPOT     = steady(min(D + 1, S)) over their context + own input + output/2

It ignores the randomness of future arrivals, preemption and KV exhaustion: the trained model
learns those as a correction (a log-ratio over this prior, see model.py).

Token velocity
--------------
Token velocity: how many prompt and output tokens per second one replica sustains within its SLO.

The autoscaler sizes pools in tokens (TokenScale, arXiv 2512.03416: prefill, network and decode
token rates per stage), so it needs each replica's velocity at the objective, not its peak
throughput. It comes from the capacity model the latency prior runs on (the pool's roofline,
`predictor/prior.py`), for the pool's current request mix (mean uncached prompt P, mean output O),
as the largest request rate r (engine time) a replica keeps within every limit:

    decode batch   D = r·O·s, the fixed point of s = steady_step(D, context D·(P + O/2), prompts at r·P)
    TPOT           s ≤ tpot_slo                          (role both, decode)
    batch slots    D ≤ max_num_seqs, KV  D·(P + O/2) ≤ kv_tokens
    TTFT           n·p·(1 + u / (2(1 - u))) + s/2 ≤ ttft_slo  (role both, prefill)
                   n = ceil(P / chunk) prefill steps of duration p, u = r·n·p the engine's busy share
                   in prefill (an M/D/1 wait for the steps ahead)

so velocity = (r·P prefill tokens/s, r·O decode tokens/s) and which limit bound it. A prefill-role
replica has no decodes and only the TTFT limit; a decode-role replica has no prefill and no TTFT
limit. Velocities are wall-clock (x the simulated engine's time scale) and multiplied by a
measured calibration factor: the median ratio of the roofline's step to the TPOT the gateway
measured on each replica's streams (`Calibration`), so an engine slower than its preset plans for
its real speed.

Output length
-------------
Output-length estimates per (tenant, model), learnt from the completions the gateway served.

Used when a request has no `max_tokens`: admission reserves the p90 (few requests overrun it, so
token buckets are rarely reconciled upward), the latency predictor uses the median.

Each (tenant, model) keeps an exponentially decayed histogram of completion lengths over log-spaced
buckets (4 per doubling, ±9 % resolution, 1 to 2**20 tokens): O(1) memory per key, O(1) update
(one multiply by a decay factor is lazily folded into a growing weight), quantiles by one cumulative
sum. The weight of a sample halves every `half_life_samples` newer samples of the same key, so
estimates follow a tenant whose usage changes. Keys live in an LRU bounded by `max_keys`. A key with
too few samples falls back to the model-wide estimate (every tenant's completions of that model).

Drift correction (DriftSched: Palaniappan, arXiv 2606.02982, corrects admission-time estimates online
by their recent bias against observed completions). The histogram is deliberately slow (hundreds of
samples per half-life), so when a tenant's outputs change, or a new tenant borrows the model-wide
estimate, its median is wrong for a long while, and always in the same direction. `predict` therefore
multiplies the median by exp(bias), where the bias is an exponential moving average (rate
`drift_rate`) of log(observed / median) over the key's recent completions, kept within
[1/`drift_max_factor`, `drift_max_factor`]. Completions that stopped at their own `max_tokens` say
only "at least that many" and are not learnt from. `LengthAccuracy` keeps the mean absolute error of
the raw and the corrected predictions, so the correction's worth is measured, not assumed.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import astuple, dataclass
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from backends.config import PoolConfig
from backends.perf.presets import DEFAULT_PRESET, Preset, resolve_preset
from backends.perf.roofline import batch_defaults, step_cost
from predictor.config import LengthSettings, PriorSettings

PRIOR_VERSION = 2  # bump when the formula changes: saved models learnt a correction to the old one
_PROBE_CONTEXT = 1024
_MIN_PREFILL_CHUNK = 64
_FIXED_POINT_ITERATIONS = 4


@dataclass(frozen=True, slots=True)
class Roofline:
    """The sim's step-time roofline as coefficients (seconds per unit; see the module docstring)."""

    k_token_s: float
    k_sampled_s: float
    k_attention_s: float
    weights_s: float
    k_kv_s: float
    comm_base_s: float
    comm_token_s: float
    step_overhead_s: float
    prefill_overhead_s: float
    frontend_s: float = 0.0  # per request, before the first token (Efficiency.frontend_s)
    sequence_overhead_s: float = 0.0  # per scheduled sequence per step (Efficiency.sequence_overhead_s)

    @classmethod
    def from_preset(cls, preset: Preset) -> Roofline:
        n = _PROBE_CONTEXT
        # a: one decode at context 0 (tokens 1, sequences 1, pairs 1, kv read 0)
        # b: one decode at context n (tokens 1, sequences 1, pairs n+1, kv read n)
        # c: one prefill of n tokens (tokens n, sequences 1, pairs n(n+1)/2, kv read 0)
        a = step_cost(preset, (), [0])
        b = step_cost(preset, (), [n])
        c = step_cost(preset, [(n, 0)], ())
        k_attention = (b.compute_s - a.compute_s) / n
        pairs_c = n * (n + 1) / 2
        k_token = ((c.compute_s - pairs_c * k_attention) - (a.compute_s - k_attention)) / (n - 1)
        k_sampled = a.compute_s - k_attention - k_token
        k_kv = (b.memory_s - a.memory_s) / n
        comm_token = (c.comm_s - a.comm_s) / (n - 1)
        return cls(
            k_token_s=k_token,
            k_sampled_s=k_sampled,
            k_attention_s=k_attention,
            weights_s=a.memory_s - k_kv,
            k_kv_s=k_kv,
            comm_base_s=a.comm_s - comm_token,
            comm_token_s=comm_token,
            step_overhead_s=a.overhead_s - preset.efficiency.sequence_overhead_s,
            prefill_overhead_s=c.overhead_s - a.overhead_s,
            frontend_s=preset.efficiency.frontend_s,
            sequence_overhead_s=preset.efficiency.sequence_overhead_s,
        )

    def step_s(
        self, tokens: float, sequences: float, attention_pairs: float, kv_read_tokens: float, has_prefill: bool
    ) -> float:
        """Duration of a step with these aggregates (same meaning as in `step_cost`)."""
        compute = self.k_token_s * tokens + self.k_sampled_s * sequences + self.k_attention_s * attention_pairs
        memory = self.weights_s + self.k_kv_s * (kv_read_tokens + tokens)
        roof = compute if compute > memory else memory
        overhead = self.step_overhead_s + self.prefill_overhead_s if has_prefill else self.step_overhead_s
        return roof + self.comm_base_s + self.comm_token_s * tokens + overhead + self.sequence_overhead_s * sequences


class PriorEstimate(NamedTuple):
    """The prior for one candidate, and the intermediate quantities it exposes as features."""

    batch_requests: float
    batch_context_tokens: float
    prefill_steps: float
    ttft_ms: float
    tpot_ms: float


class LatencyPrior:
    """TTFT/TPOT of a request on each candidate endpoint from the roofline (module docstring)."""

    def __init__(
        self,
        roofline: Roofline,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preset_name: str = "",
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.roofline = roofline
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preset_name = preset_name
        self.time_scale = time_scale  # engine seconds per wall second (the simulated engine's --time-scale)

    @property
    def id(self) -> str:
        """Identifies this prior in saved models (a model only fits the prior it was trained over).

        It carries a digest of the roofline's coefficients, so recalibrating the presets
        (`backends/perf/presets.py`) retires models trained over the old physics as a formula change does.
        """
        scale = f"|x{self.time_scale:g}" if self.time_scale != 1.0 else ""
        physics = hashlib.sha256(repr(astuple(self.roofline)).encode()).hexdigest()[:8]
        return (
            f"{self.preset_name}|v{PRIOR_VERSION}|r{physics}|seqs={self.max_num_seqs}"
            f"|tokens={self.max_num_batched_tokens}{scale}"
        )

    @classmethod
    def for_pool(cls, pool: PoolConfig | None, settings: PriorSettings) -> LatencyPrior:
        """The pool's preset (`model@hw`), or the sim's default preset when the pool names none.

        Engine limits: the pool's, else the settings', else vLLM's defaults for the device memory
        (the same `batch_defaults` the simulated engine applies).
        """
        preset_name = (pool.preset if pool is not None else None) or DEFAULT_PRESET
        preset = resolve_preset(preset_name, pool.tensor_parallel if pool is not None else None)
        default_seqs, default_tokens = batch_defaults(preset)
        return cls(
            Roofline.from_preset(preset),
            max_num_seqs=(pool.max_num_seqs if pool else None) or settings.max_num_seqs or default_seqs,
            max_num_batched_tokens=(pool.max_num_batched_tokens if pool else None)
            or settings.max_num_batched_tokens
            or default_tokens,
            preset_name=preset.name,
            time_scale=settings.time_scale,
        )

    def estimate(
        self,
        input_tokens: float,
        cached_tokens: float,
        output_tokens: float,
        running: float,
        waiting: float,
        inflight_requests: float,
        inflight_prefill_tokens: float,
        inflight_decode_tokens: float,
        prefill_rate_tps: float = 0.0,
        since_last_token_ms: float = -1.0,
    ) -> PriorEstimate:
        """The prior for one candidate (plain floats: cheaper than numpy for a handful of candidates).

        Inputs and outputs are wall-clock (ms, tokens/s); the roofline runs in engine time, which a
        simulated engine's `time_scale` compresses.
        """
        scale = self.time_scale
        if scale != 1.0:
            prefill_rate_tps /= scale
            if since_last_token_ms >= 0:
                since_last_token_ms *= scale
        step_s = self.roofline.step_s
        seqs_limit = self.max_num_seqs
        uncached = input_tokens - cached_tokens
        decoding = max(running, inflight_requests - waiting)
        if decoding > seqs_limit:
            decoding = seqs_limit
        # context of the batch already decoding; guess from this request when the gateway knows none
        decode_ctx = inflight_decode_tokens or decoding * (input_tokens + output_tokens / 2)

        work = inflight_prefill_tokens + uncached
        chunk = self.max_num_batched_tokens - decoding
        if chunk < _MIN_PREFILL_CHUNK:
            chunk = _MIN_PREFILL_CHUNK
        steps = math.ceil(work / chunk) or 1
        per_step = work / steps
        # each prompt token attends to everything before it (its total is independent of chunking);
        # a chunk reads the KV of its context before the chunk: on average cached + (uncached - chunk)/2
        prefill_pairs = per_step * (cached_tokens + (uncached + 1) / 2)
        prefill_kv_read = cached_tokens + max(uncached - per_step, 0.0) / 2
        prefill_step = step_s(
            per_step + decoding,
            decoding + 1,
            prefill_pairs + decode_ctx + decoding,
            prefill_kv_read + decode_ctx,
            True,
        )
        ttft_s = self.roofline.frontend_s + steps * prefill_step
        if decoding > 0 or inflight_prefill_tokens > 0:  # arriving mid-step: wait for its end
            step_now = self._steady_step_s(decoding, decode_ctx, prefill_rate_tps, input_tokens)
            if since_last_token_ms >= 0:  # steps run back to back: this one began at the last token
                ttft_s += max(step_now - since_last_token_ms / 1e3, 0.0)
            else:
                ttft_s += 0.5 * step_now
        excess = decoding + waiting + 1 - seqs_limit
        if excess > 0:  # the batch is full: wait for running requests to finish (half their output)
            decode_only = step_s(decoding, decoding, decode_ctx + decoding, decode_ctx, False)
            ttft_s += excess * output_tokens / (2 * max(decoding, 1.0)) * decode_only

        batch = decoding + 1 if decoding < seqs_limit else seqs_limit
        batch_ctx = decode_ctx + input_tokens + output_tokens / 2
        tpot_s = self._steady_step_s(batch, batch_ctx, prefill_rate_tps, input_tokens)
        return PriorEstimate(batch, batch_ctx, float(steps), ttft_s * 1e3 / scale, tpot_s * 1e3 / scale)

    def steady_step_s(self, decodes: float, decode_ctx: float, prefill_rate_tps: float, prompt_tokens: float) -> float:
        """Mean engine step (engine seconds) of `decodes` requests over `decode_ctx` context tokens
        while prompts of `prompt_tokens` arrive at `prefill_rate_tps` (engine time)."""
        return self._steady_step_s(decodes, decode_ctx, prefill_rate_tps, prompt_tokens)

    def _steady_step_s(self, decodes: float, decode_ctx: float, prefill_rate_tps: float, prompt_tokens: float) -> float:
        """Mean step of `decodes` requests while prompts arrive at `prefill_rate_tps` tokens/s.

        Fluid approximation, iterated to its fixed point: a step carries the prompt tokens that
        arrived during the one before (q = rate x step, at most the chunk budget), in whole prompts
        of about `prompt_tokens` (this request's length stands in for the others'); so a share
        min(1, q / prompt) of steps carries a prefill chunk and pays the prefill overhead.
        """
        step_s = self.roofline.step_s
        base = step_s(decodes, decodes, decode_ctx + decodes, decode_ctx, False)
        if prefill_rate_tps <= 0:
            return base
        budget = max(self.max_num_batched_tokens - decodes, _MIN_PREFILL_CHUNK)
        chunk = min(max(prompt_tokens, 1.0), budget)
        context = prompt_tokens / 2
        step = base
        for _ in range(_FIXED_POINT_ITERATIONS):
            tokens = min(prefill_rate_tps * step, budget)
            share = min(1.0, tokens / chunk)
            carried = tokens / share if share > 0 else 0.0
            with_prefill = step_s(
                decodes + carried, decodes + 1, decode_ctx + decodes + carried * context, decode_ctx + context, True
            )
            step = share * with_prefill + (1 - share) * base
        return step


_SEARCH_STEPS = 40
_FIXED_POINT_STEPS = 16
_MIN_CHUNK = 64


@dataclass(frozen=True, slots=True)
class Mix:
    """A pool's recent requests on average: uncached prompt tokens and output tokens."""

    prompt_tokens: float = 1000.0
    output_tokens: float = 200.0


@dataclass(frozen=True, slots=True)
class Velocity:
    """One replica's sustainable token rates at the SLO (wall-clock tokens/s) and what bounds them."""

    prefill_tps: float
    decode_tps: float
    requests_per_s: float
    batch: float  # decode batch at that rate
    limit: str  # tpot | ttft | seqs | kv | none


def replica_velocity(
    prior: LatencyPrior,
    mix: Mix,
    *,
    ttft_slo_ms: float,
    tpot_slo_ms: float,
    role: str = "both",
    kv_tokens: float | None = None,
    factor: float = 1.0,
) -> Velocity:
    """The velocity of one replica of `prior`'s pool serving `mix` (module docstring)."""
    scale = prior.time_scale
    ttft_s = ttft_slo_ms / 1e3 * scale  # engine seconds
    tpot_s = tpot_slo_ms / 1e3 * scale
    prompt = max(mix.prompt_tokens, 1.0)
    output = max(mix.output_tokens, 1.0) if role != "prefill" else 1.0

    def check(rate: float) -> str | None:
        return _violation(prior, rate, prompt, output, ttft_s, tpot_s, role, kv_tokens)

    low, high = 0.0, 1.0
    while check(high) is None and high < 1e7:
        low, high = high, high * 2
    for _ in range(_SEARCH_STEPS):
        mid = (low + high) / 2
        if check(mid) is None:
            low = mid
        else:
            high = mid
    limit = check(high) or "none"
    batch = _decode_batch(prior, low, prompt, output, role)[0] if role != "prefill" else 0.0
    rate = low * scale * factor  # wall-clock requests/s
    return Velocity(rate * prompt if role != "decode" else 0.0, rate * output, rate, batch, limit)


def _decode_batch(prior: LatencyPrior, rate: float, prompt: float, output: float, role: str) -> tuple[float, float]:
    """(D, s): the decode batch and mean step at `rate` requests per engine second (fixed point)."""
    prefill_rate = rate * prompt if role == "both" else 0.0
    batch, step = 1.0, 0.0
    for _ in range(_FIXED_POINT_STEPS):
        context = batch * (prompt + output / 2)
        step = prior.steady_step_s(batch, context, prefill_rate, prompt)
        batch = max(rate * output * step, 1.0)
    return batch, step


def _violation(
    prior: LatencyPrior,
    rate: float,
    prompt: float,
    output: float,
    ttft_s: float,
    tpot_s: float,
    role: str,
    kv_tokens: float | None,
) -> str | None:
    """The first limit `rate` breaks, or None when a replica keeps every one."""
    batch, step = (0.0, 0.0) if role == "prefill" else _decode_batch(prior, rate, prompt, output, role)
    if role != "prefill":
        if step > tpot_s:
            return "tpot"
        if batch > prior.max_num_seqs:
            return "seqs"
        if kv_tokens is not None and batch * (prompt + output / 2) > kv_tokens:
            return "kv"
    if role == "decode":
        return None
    decodes = batch
    chunk = max(prior.max_num_batched_tokens - decodes, _MIN_CHUNK)
    steps = math.ceil(prompt / chunk)
    per_step = prompt / steps
    context = batch * (prompt + output / 2)
    prefill_step = prior.roofline.step_s(
        per_step + decodes, decodes + 1, per_step * (per_step + 1) / 2 + context + decodes, context, True
    )
    busy = rate * steps * prefill_step
    if busy >= 1.0:
        return "ttft"
    ttft = steps * prefill_step * (1 + busy / (2 * (1 - busy))) + step / 2
    return "ttft" if ttft > ttft_s else None


class Calibration:
    """How fast a pool's engines really decode against the roofline: the median of
    roofline step / measured TPOT over the last `window` streams (1.0 until `min_samples`)."""

    def __init__(self, window: int = 200, min_samples: int = 20, bounds: tuple[float, float] = (0.25, 2.0)) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.bounds = bounds

    def observe(self, prior: LatencyPrior, tpot_ms: float, batch: float, context_tokens: float) -> None:
        """One finished stream: its measured TPOT (wall ms) beside the batch it decoded in."""
        if tpot_ms <= 0 or batch < 1:
            return
        modelled_ms = prior.steady_step_s(batch, context_tokens, 0.0, 0.0) * 1e3 / prior.time_scale
        self._ratios.append(modelled_ms / tpot_ms)

    @property
    def factor(self) -> float:
        if len(self._ratios) < self.min_samples:
            return 1.0
        low, high = self.bounds
        return min(max(statistics.median(self._ratios), low), high)

    @property
    def samples(self) -> int:
        return len(self._ratios)


_BUCKETS_PER_DOUBLING = 4
_MAX_DOUBLINGS = 20
_NUM_BUCKETS = _BUCKETS_PER_DOUBLING * _MAX_DOUBLINGS + 1
# bucket b holds lengths in [2**((b-0.5)/4), 2**((b+0.5)/4)); its representative value is 2**(b/4)
_BUCKET_VALUE = 2.0 ** (np.arange(_NUM_BUCKETS) / _BUCKETS_PER_DOUBLING)
_BUCKET_VALUES: list[float] = _BUCKET_VALUE.tolist()  # the same doubles, read without numpy scalars
_RENORMALISE_ABOVE = 1e100
_ALL_TENANTS = "*"
_MAX_PREDICTED = 256


@dataclass(frozen=True, slots=True)
class OutputPrediction:
    """One request's predicted completion tokens: `raw_tokens` the histogram's median, `tokens` after
    the drift correction (both within the request's max_tokens); `uncapped_raw` before the cap (what
    the drift is learnt against); `max_tokens` the request's own limit, if any."""

    raw_tokens: float
    tokens: float
    uncapped_raw: float
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class LengthEstimate:
    """Estimated completion tokens of the next request; `samples` is the effective (decayed) count."""

    mean_tokens: float
    p50_tokens: int
    p90_tokens: int
    samples: float


class _DecayedHistogram:
    def __init__(self, decay: float) -> None:
        self._growth = 1.0 / decay  # new samples weigh growth**n instead of decaying all old ones
        self._weight = 1.0
        # a list, not a numpy array: `add` (twice per request) updates one bucket and the quantiles
        # take one running sum (`accumulate`, in C) and a bisection; per call, numpy's overhead on 81
        # buckets was most of the cost. Same doubles, same order of additions as np.cumsum.
        self._counts: list[float] = [0.0] * _NUM_BUCKETS
        self._sum_tokens = 0.0
        self._sum_weight = 0.0
        self.observed = 0
        # asked on every request (the gate's prediction), changed only by `add`: kept until then
        self._estimate: LengthEstimate | None = None

    def add(self, tokens: int) -> None:
        self._estimate = None
        bucket = min(_NUM_BUCKETS - 1, max(0, round(math.log2(max(tokens, 1)) * _BUCKETS_PER_DOUBLING)))
        self._weight *= self._growth
        if self._weight > _RENORMALISE_ABOVE:
            weight = self._weight
            self._counts = [count / weight for count in self._counts]
            self._sum_tokens /= self._weight
            self._sum_weight /= self._weight
            self._weight = 1.0
        self._counts[bucket] += self._weight
        self._sum_tokens += self._weight * tokens
        self._sum_weight += self._weight
        self.observed += 1

    @property
    def effective_samples(self) -> float:
        """Sum of sample weights relative to the newest sample's weight."""
        return self._sum_weight / self._weight

    def quantile(self, q: float) -> int:
        cumulative = list(accumulate(self._counts))
        bucket = bisect_left(cumulative, q * cumulative[-1])  # np.searchsorted's side="left"
        return max(1, round(_BUCKET_VALUES[min(bucket, _NUM_BUCKETS - 1)]))

    def estimate(self) -> LengthEstimate:
        if self._estimate is None:
            # both quantiles from one cumulative sum
            cumulative = list(accumulate(self._counts))
            total = cumulative[-1]
            p50, p90 = bisect_left(cumulative, 0.5 * total), bisect_left(cumulative, 0.9 * total)
            self._estimate = LengthEstimate(
                mean_tokens=self._sum_tokens / self._sum_weight,
                p50_tokens=max(1, round(_BUCKET_VALUES[min(p50, _NUM_BUCKETS - 1)])),
                p90_tokens=max(1, round(_BUCKET_VALUES[min(p90, _NUM_BUCKETS - 1)])),
                samples=self.effective_samples,
            )
        return self._estimate


class LengthAccuracy:
    """Mean absolute error (tokens) of the raw and the drift-corrected predictions."""

    __slots__ = ("abs_error_corrected", "abs_error_raw", "samples")

    def __init__(self) -> None:
        self.samples = 0
        self.abs_error_raw = 0.0
        self.abs_error_corrected = 0.0

    def record(self, predicted: OutputPrediction, observed: int) -> None:
        self.samples += 1
        self.abs_error_raw += abs(observed - predicted.raw_tokens)
        self.abs_error_corrected += abs(observed - predicted.tokens)

    def status(self) -> dict[str, float | int | None]:
        n = self.samples
        return {
            "samples": n,
            "mae_raw_tokens": round(self.abs_error_raw / n, 2) if n else None,
            "mae_corrected_tokens": round(self.abs_error_corrected / n, 2) if n else None,
        }


class OutputLengthEstimator:
    """Completion-length estimates per (tenant, model), bounded in memory (module docstring)."""

    def __init__(self, settings: LengthSettings) -> None:
        self.settings = settings
        self._decay = 0.5 ** (1.0 / settings.half_life_samples)
        self._keys: OrderedDict[tuple[str, str], _DecayedHistogram] = OrderedDict()
        self._bias: OrderedDict[tuple[str, str], float] = OrderedDict()  # EMA of log(observed / median)
        self._max_log = math.log(settings.drift_max_factor)
        self.accuracy = LengthAccuracy()
        # predictions made since the last `observe` (which may change any of them): the requests
        # admitted between two finished ones ask the same; bounded, since `max_tokens` comes from
        # the client
        self._predicted: dict[tuple[str, str, int | None], OutputPrediction] = {}

    def predict(self, tenant: str, model: str, max_tokens: int | None = None) -> OutputPrediction:
        """The request's completion tokens: the median (else `default_output_tokens`), corrected for
        the key's drift, within `max_tokens`."""
        memo = (tenant, model, max_tokens)
        made = self._predicted.get(memo)
        if made is not None:
            return made
        estimate = self.estimate(tenant, model)
        raw = float(estimate.p50_tokens if estimate is not None else self.settings.default_output_tokens)
        corrected = raw * math.exp(self._bias.get((tenant, model), 0.0))
        if max_tokens is not None:
            made = OutputPrediction(min(raw, max_tokens), min(corrected, max_tokens), raw, max_tokens)
        else:
            made = OutputPrediction(raw, corrected, raw)
        if len(self._predicted) >= _MAX_PREDICTED:
            self._predicted.clear()
        self._predicted[memo] = made
        return made

    def observe(
        self, tenant: str, model: str, completion_tokens: int, predicted: OutputPrediction | None = None
    ) -> None:
        """Record one finished request's completion tokens (skip requests that were cut short);
        with the prediction made for it, learn the drift and score both predictions."""
        if completion_tokens < 0:
            return
        self._predicted.clear()
        if predicted is not None:
            self.accuracy.record(predicted, completion_tokens)
            self._learn_drift((tenant, model), predicted, completion_tokens)
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is None:
                histogram = self._keys[key] = _DecayedHistogram(self._decay)
                while len(self._keys) > self.settings.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            histogram.add(completion_tokens)

    def _learn_drift(self, key: tuple[str, str], predicted: OutputPrediction, observed: int) -> None:
        rate = self.settings.drift_rate
        if rate <= 0 or (predicted.max_tokens is not None and observed >= predicted.max_tokens):
            return  # off, or stopped by its own limit: it says only "at least that many"
        error = math.log(max(observed, 1) / max(predicted.uncapped_raw, 1.0))
        bias = self._bias.pop(key, 0.0)
        bias += rate * (error - bias)
        self._bias[key] = min(max(bias, -self._max_log), self._max_log)
        while len(self._bias) > self.settings.max_keys:
            self._bias.popitem(last=False)

    def drift_factor(self, tenant: str, model: str) -> float:
        """The correction `predict` applies to this key's median now."""
        return math.exp(self._bias.get((tenant, model), 0.0))

    def estimate(self, tenant: str, model: str) -> LengthEstimate | None:
        """The tenant's estimate, else the model-wide one, else None (fewer than `min_samples`)."""
        for key in ((tenant, model), (_ALL_TENANTS, model)):
            histogram = self._keys.get(key)
            if histogram is not None and histogram.observed >= self.settings.min_samples:
                return histogram.estimate()
        return None

    def __len__(self) -> int:
        return len(self._keys)
