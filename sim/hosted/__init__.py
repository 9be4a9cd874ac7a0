"""Hosted-provider stand-ins: each provider's documented wire format on loopback (`python -m sim.hosted PROVIDER`).

They let the gateway's hosted pools, their tests and the spill-over benchmark run without accounts:
the same request and response shapes as the provider (checked with the provider's official SDK),
the same refusals, prompt caching, rate-limit headers and 429s, and latency knobs. Shared parts are
in `sim.hosted.common`; `sim.hosted.__main__.PROVIDERS` lists the stand-ins.
"""
