"""Records for ledger tests: deterministic, varied, and cheap to make in bulk."""

from __future__ import annotations

from gateway.request.record import RequestRecord

TENANTS = ("acme", "globex", "initech")
MODELS = ("llama-3.1-8b", "qwen2.5-7b")


def make_record(i: int, *, started_at_unix_s: float = 1_750_000_000.0, **overrides: object) -> RequestRecord:
    record = RequestRecord(
        request_id=f"req-{i:08d}",
        api="chat",
        started_at_unix_s=started_at_unix_s + i * 0.01,
        tenant=TENANTS[i % 3],
        key_id=f"{TENANTS[i % 3]}-k{i % 2}",
        requested_model=MODELS[i % 2],
        model=MODELS[i % 2],
        served_model=MODELS[i % 2],
        pool=f"{MODELS[i % 2]}-pool",
        endpoint=f"{MODELS[i % 2]}-pool/both-{i % 4}",
        engine="sim",
        status="ok" if i % 17 else "error",
        http_status=200 if i % 17 else 502,
        prompt_tokens=100 + i % 50,
        cached_tokens=(i % 5) * 10,
        completion_tokens=20 + i % 30,
        usage_source="engine",
        cost_usd=(100 + i % 50) * 2e-7 + (20 + i % 30) * 6e-7,
        ttft_s=0.05 + (i % 10) * 0.01 if i % 17 else None,
        tpot_s=0.01,
        duration_s=0.5,
    )
    for name, value in overrides.items():
        setattr(record, name, value)
    return record
