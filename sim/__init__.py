"""The simulated engine: a vLLM-compatible server whose GPU is a calibrated performance model.

Its GPU is `backends/perf` (presets, roofline, KV capacity), shared with the latency predictor.
Modules: kv_cache (paged blocks, prefix caching, the DRAM tier and the shared store), scheduler
(vLLM V1 step, the request), engine (the step loop, PD, the simulated clock, sleep mode), metrics
(Prometheus), kv_events (ZMQ), http_api (OpenAI, Responses and Messages routes), generation (checks,
prompt ids, streams), outputs (tool calls, JSON, stop, n), server (in-process start, ``tokenway sim``).
"""
