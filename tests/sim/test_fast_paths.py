"""The shortcuts that make the simulator cheap give the same answers as the plain versions."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends import tokenization
from backends.block_hash import NONE_HASH, hash_block, hash_blocks
from backends.perf import roofline
from backends.perf.presets import preset_names, resolve_preset
from sim import text_gen
from sim.config import build_engine_config
from sim.generation import WRITE_BUFFER_LIMIT, ChunkTemplate, MessageIdsCache, TokenWriter
from sim.metrics import TOKEN_LATENCY_BUCKETS, EngineMetrics
from sim.scheduler import Request, Status, StepStats


@pytest.mark.slow
def test_step_timer_is_bit_identical_to_step_time_s() -> None:
    rng = random.Random(3)
    for name in preset_names():
        preset = resolve_preset(name)
        timer = roofline.StepTimer(preset)
        for _ in range(200):
            chunks = [(rng.randint(1, 8192), rng.randint(0, 30000)) for _ in range(rng.randint(0, 3))]
            contexts = [rng.randint(1, 60000) for _ in range(rng.choice((0, 1, 7, 300)))]
            assert timer(chunks, len(contexts), sum(contexts)) == roofline.step_time_s(preset, chunks, contexts)


def test_hash_blocks_chains_hash_block() -> None:
    rng = random.Random(5)
    for length in (0, 15, 16, 17, 1000):
        ids = [rng.randrange(200_000) for _ in range(length)]
        for salt in (None, "tenant-a"):
            expected, parent = [], NONE_HASH
            for start in range(0, length - 15, 16):
                parent = hash_block(parent, ids[start : start + 16], salt if start == 0 else None)
                expected.append(parent)
            assert hash_blocks(ids, 16, salt) == expected


def _reference_generate_ids(rng: random.Random, count: int) -> list[int]:
    """generate_ids as first written, with rng.choice and rng.randint."""
    vocab = text_gen.vocabulary()
    ids = [rng.choice(vocab.first_ids)]
    next_stop = rng.randint(6, 20)
    after_stop = False
    while len(ids) < count:
        if next_stop == 0:
            ids.append(vocab.period_id)
            next_stop = rng.randint(6, 20)
            after_stop = True
            continue
        ids.append(rng.choice(vocab.upper_ids) if after_stop else rng.choice(vocab.lower_ids))
        after_stop = False
        next_stop -= 1
    return ids


def test_generated_ids_are_the_same_draws_as_choice_and_randint() -> None:
    for seed in range(50):
        for count in (1, 2, 21, 400):
            expected = _reference_generate_ids(random.Random(seed), count)
            assert text_gen.generate_ids(random.Random(seed), count) == expected


def test_json_text_is_the_escaped_text_of_every_vocabulary_id() -> None:
    table = text_gen.json_text()
    for token_id, text in text_gen.vocabulary().text_by_id.items():
        assert orjson.loads(b'"' + table[token_id] + b'"') == text


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("model", ["m", 'we"ird\\model \x01 é', "\x01"])
def test_chunk_template_is_orjson_of_the_chunk(chat: bool, model: str) -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": model}
    template = ChunkTemplate(base, chat)
    for text in ("", " the", " Hello.", 'quote " and \\ \n'):
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        expected = b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
        assert template.event(orjson.dumps(text)[1:-1]) == expected


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


def _chunk_text(frame: bytes) -> str:
    size, _, rest = frame.partition(b"\r\n")
    assert rest.endswith(b"\r\n") and int(size, 16) == len(rest) - 2
    event = rest[:-2]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    data: dict[str, Any] = orjson.loads(event[6:])
    return str(data["choices"][0]["delta"]["content"])


async def test_token_writer_frames_each_step_and_holds_tokens_while_the_client_lags() -> None:
    ids = text_gen.generate_ids(random.Random(1), 6)
    req = Request("r", [1, 2, 3], ids, "length", 0.0, 6)
    req.status = Status.RUNNING
    transport = _Transport()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    writer = TokenWriter(req, transport, ChunkTemplate(base, chat=True), True, done)  # type: ignore[arg-type]

    req.num_output = 1
    writer.step()
    writer.step()  # nothing new: nothing written
    transport.buffered = WRITE_BUFFER_LIMIT + 1
    req.num_output = 3
    writer.step()  # the client does not read: held back
    transport.buffered = 0
    req.num_output = 4
    writer.step()
    assert [_chunk_text(w) for w in transport.writes] == [text_gen.render(ids[:1]), text_gen.render(ids[1:4])]
    transport.closing = True
    req.num_output = 5
    writer.step()
    assert len(transport.writes) == 2 and writer.sent == 4 and not done.done()
    req.status = Status.FINISHED
    writer.step()
    assert done.done()


def test_message_cache_gives_chat_prompt_ids() -> None:
    cache = MessageIdsCache(max_tokens=400)
    conversations: list[tuple[list[dict[str, Any]], Any]] = [
        ([{"role": "user", "content": "Hello there"}], None),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], None),
        (
            [
                {"role": "user", "content": [{"type": "text", "text": "part"}, {"type": "image_url"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
                {"role": "tool", "name": "f", "content": "42"},
            ],
            [{"type": "function", "function": {"name": "f"}}],
        ),
        ([{"content": "no role"}, {"role": "user", "content": "word " * 300}], None),
    ]
    for _ in range(2):
        for messages, tools in conversations:
            assert cache.chat_prompt_ids(messages, tools) == tokenization.chat_prompt_ids(messages, tools)
    assert cache.hits > 0 and cache.tokens <= 400


def test_step_stats_count_inter_token_latencies_by_value() -> None:
    stats = StepStats()
    stats.itl_counts.update({0.01: 3, 0.02: 1})
    assert sorted(stats.itls) == [0.01, 0.01, 0.01, 0.02]
    stats.generation_tokens = 4
    stats.clear()
    assert stats.itls == [] and stats.generation_tokens == 0


def test_histograms_render_as_prometheus_client_would() -> None:
    values = [0.004, 0.01, 0.01, 0.3, 2.0, 99.0, 0.0251]
    metrics = EngineMetrics(build_engine_config("llama-3.1-8b@h100"))
    stats = StepStats()
    for value in values:
        stats.itl_counts[value] = stats.itl_counts.get(value, 0) + 1
    metrics.record_step(stats, 0)

    registry = CollectorRegistry()
    reference = Histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        ["model_name", "engine"],
        buckets=TOKEN_LATENCY_BUCKETS,
        registry=registry,
    )
    for value in values:
        reference.labels("meta-llama/Llama-3.1-8B", "0").observe(value)

    def samples(text: bytes) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text.decode())
            if family.name == "vllm:inter_token_latency_seconds"
            for s in family.samples
            if not s.name.endswith("_created")
        }

    ours, theirs = samples(metrics.render()), samples(generate_latest(registry))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value), key
