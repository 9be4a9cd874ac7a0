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

The prefix-cache salt is always the gateway's (`cache_salt` below): a tenant allowed to name
`cache_salt` only splits its own cache further, it never reaches another tenant's blocks.
"""

from __future__ import annotations

import functools
import hashlib
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
    if not present:  # almost always: no generator, no sort
        return body if isinstance(body, dict) else dict(body), ()
    dropped = tuple(sorted(name for name in present if name not in allowed))
    if not dropped:
        return body if isinstance(body, dict) else dict(body), ()
    return {k: v for k, v in body.items() if k not in dropped}, dropped


# The salt needs no secret: clients cannot set the engine's `cache_salt` (it is dropped above), so a
# salt only has to differ between cache groups, be the same on every gateway replica (the engines'
# caches and the prefix index are shared by all of them) and not spell the tenant's name out in the
# engine's logs. A keyed BLAKE2b of the group does all three; the key only separates this use.
_SALT_KEY = b"tokenway prefix-cache salt v1"


def cache_salt(group: str, client_salt: str | None = None) -> str:
    """The engine's `cache_salt` for a request of cache group `group` (`tenants.<t>.cache_group`,
    else the tenant's name). A trusted tenant's own salt (`engine_fields: [cache_salt]`) is folded
    in, so it splits that group's cache but can never name another group's."""
    if not client_salt:
        return _group_salt(group)  # every request pays this: the groups are few, their salts kept
    return _salt(group, client_salt)


@functools.lru_cache(maxsize=4096)  # groups are tenants' (configuration or the admin API): bounded anyway
def _group_salt(group: str) -> str:
    return _salt(group, None)


def _salt(group: str, client_salt: str | None) -> str:
    name = group.encode("utf-8", "surrogatepass")
    material = b"%d:%s" % (len(name), name)  # length-prefixed: no (group, salt) pair spells another
    if client_salt:
        material += client_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(material, key=_SALT_KEY, digest_size=16).hexdigest()
