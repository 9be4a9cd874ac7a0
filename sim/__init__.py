"""The simulated engine: a vLLM-compatible server whose GPU is a calibrated performance model.

Its GPU is `backends/perf` (presets, roofline, KV capacity), shared with the latency predictor.
Modules: kv_cache
(paged blocks, prefix caching), scheduler (vLLM V1 step), clock (simulated time), engine (the step
loop, PD), metrics (Prometheus), kv_events (ZMQ), http_api (OpenAI routes), server (in-process start),
cli (``tokenway sim``).
"""
