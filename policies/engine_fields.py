"""Request fields that steer the engine itself, which clients may not set unless the policy says so.

OpenAI-compatible engines accept, beside the OpenAI fields, fields that control their own machinery
(vLLM `vllm/entrypoints/openai/chat_completion/protocol.py`, TensorRT-LLM's `openai_protocol.py`):
the KV-transfer handshake of disaggregated serving (a client naming `do_remote_prefill` with its own
`remote_host` makes the engine connect there and report the prompt as cached), the scheduler's
priority, the prefix-cache salt, the engine's request and session ids, extra sampling arguments
and, on TensorRT-LLM, LoRA adapters by path. The gateway sets those it needs from its own decisions
(the PD handshake from the prefill engine's answer, the priority from the tenant's tier); from a
client they are dropped, unless the tenant's `engine_fields` names them (a trusted tenant, e.g. one
that runs its own disaggregated client).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

ENGINE_CONTROL_FIELDS = frozenset(
    {
        "kv_transfer_params",  # vLLM / vllm-ascend PD handshake
        "ec_transfer_params",  # vLLM encoder-cache transfer
        "disaggregated_params",  # TensorRT-LLM PD handshake
        "priority",  # scheduler priority: from the tenant's tier
        "cache_salt",  # prefix-cache isolation
        "request_id",  # the engine's own id (collisions, log confusion)
        "session_id",
        "vllm_xargs",  # SamplingParams.extra_args
        "lora_request",  # TensorRT-LLM: an adapter by path
    }
)


def client_body(body: Mapping[str, Any], allowed: Collection[str] = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`body` without the engine-control fields `allowed` does not name, and the names dropped. The
    body is returned as it is (no copy) when it carries none, which is almost always."""
    present = ENGINE_CONTROL_FIELDS.intersection(body)
    dropped = tuple(sorted(name for name in present if name not in allowed))
    if not dropped:
        return body if isinstance(body, dict) else dict(body), ()
    return {k: v for k, v in body.items() if k not in dropped}, dropped
