"""One request inside the simulated engine: its tokens, its place in the schedule, its timestamps.

All times are simulated seconds on the engine's clock. The output is planned at admission (ids and
length are deterministic), and revealed one token per step; `num_output` says how much is known.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_IDS = random.Random()  # seeded from os.urandom once; a uuid4 per request costs a getrandom call


def new_id() -> str:
    """32 random hex digits, like ``uuid.uuid4().hex`` (without the syscall)."""
    return f"{_IDS.getrandbits(128):032x}"


class Status(enum.Enum):
    WAITING = "waiting"
    PULLING = "pulling"  # decode leg of PD: waiting for its KV to arrive from the prefill instance
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # planned output; finishing when num_output reaches len(output_ids)
    stop_reason_at_end: str  # "length" (max_tokens or context) or "stop" (the model's own end)
    arrival_s: float
    max_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (sim/lora.py); salts its block hashes
    remote_prefill: dict[str, Any] | None = None  # kv_transfer_params of a decode leg
    remote_decode: bool = False  # a prefill leg: keep the blocks for the decode instance

    status: Status = Status.WAITING
    num_output: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first scheduling
    num_external_tokens: int = 0  # of which pulled from a prefill instance
    num_preemptions: int = 0
    prefix_counted: bool = False
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None
    kv_pull_s: float = 0.0
    pooling: bool = False  # an embedding: finishes when its prompt is computed, without output
    # Called by the engine after a step that revealed a token of this request or finished it.
    notify: Callable[[], None] | None = None
    num_prompt: int = field(init=False)  # len(prompt_ids), read on every step

    def __post_init__(self) -> None:
        self.num_prompt = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def timings(self) -> dict[str, float | int]:
        """The per-request metrics object (simulated seconds) returned with the response."""
        arrival = self.arrival_s
        scheduled = self.first_scheduled_s if self.first_scheduled_s is not None else arrival
        first = self.first_token_s if self.first_token_s is not None else scheduled
        last = self.last_token_s if self.last_token_s is not None else first
        end = self.finished_s if self.finished_s is not None else last
        tpot = (last - first) / (self.num_output - 1) if self.num_output > 1 else 0.0
        return {
            "arrival_s": round(arrival, 9),
            "queue_s": round(scheduled - arrival, 9),
            "ttft_s": round(first - arrival, 9),
            "tpot_s": round(tpot, 9),
            "prefill_s": round(first - scheduled, 9),
            "decode_s": round(last - first, 9),
            "e2e_s": round(end - arrival, 9),
            "kv_pull_s": round(self.kv_pull_s, 9),
            "prompt_tokens": self.num_prompt,
            "completion_tokens": self.num_output,
            "cached_tokens": self.num_cached_tokens or 0,
            "preemptions": self.num_preemptions,
        }
