"""Counting with the model's own tokenizer: cached per prompt, off the loop when long, exact ids."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from backends.tokenization import ModelTokenizer
from policies.estimate import SOURCE_ESTIMATE, SOURCE_MODEL, ModelTokenizerCounter, PromptEstimator


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model_dir)


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("api", "body"),
    [
        pytest.param("chat", {"messages": [{"role": "user", "content": "東京の天気は"}]}, id="chat-cjk"),
        pytest.param("chat", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, id="chat-tools"),
        pytest.param("completions", {"prompt": "Once upon a time, ünïcödé"}, id="completion"),
        pytest.param("completions", {"prompt": [3, 4, 5]}, id="completion-ids"),
    ],
)
async def test_counts_equal_the_model_tokenizer(api: str, body: dict[str, object], tokenizer: ModelTokenizer) -> None:
    counted = await ModelTokenizerCounter(tokenizer).count(api, body)
    if api == "chat":
        expected = tokenizer.chat_ids(body["messages"], body.get("tools"))  # type: ignore[arg-type]
    else:
        expected = tokenizer.completion_ids(body["prompt"])  # type: ignore[arg-type]
    assert counted is not None and counted.source == SOURCE_MODEL
    assert counted.tokens == len(expected) and list(counted.ids or ()) == expected


async def test_batches_and_embeddings_count_each_text_with_special_tokens(tokenizer: ModelTokenizer) -> None:
    counter = ModelTokenizerCounter(tokenizer)
    each = [len(tokenizer.completion_ids(t)) for t in ("a b", "c d e")]
    batch = await counter.count("completions", {"prompt": ["a b", "c d e"]})
    embeddings = await counter.count("embeddings", {"input": ["a b", "c d e"]})
    assert batch is not None and embeddings is not None
    assert batch.tokens == embeddings.tokens == sum(each) and batch.ids is None


async def test_repeated_prompts_hit_the_cache_and_long_ones_are_counted_off_loop(tokenizer: ModelTokenizer) -> None:
    counter = ModelTokenizerCounter(tokenizer, offload_chars=50)
    long = {"messages": [{"role": "user", "content": "def f(x): return x " * 100}]}
    misses = []
    counts = []
    for _ in range(3):
        counts.append(await counter.count("chat", long))
        misses.append(counter.describe()["cache_misses"])
    assert counts[0] == counts[1] == counts[2]
    # the first encodes its pieces; the second finds them all (only the whole prompt's key misses) and
    # keeps the whole prompt, having seen it twice; the third is answered by that one look-up
    assert misses[0] >= 3 and misses[1] - misses[0] == 1 and misses[2] == misses[1]


async def test_a_growing_conversation_encodes_only_its_new_pieces(tokenizer: ModelTokenizer) -> None:
    """Agent turns: each request repeats the conversation so far and adds a turn. The counts are the
    whole encode's, and each turn looks up as many pieces as it adds (its old ones are all hits)."""
    assert tokenizer.pieces is not None and ModelTokenizerCounter(tokenizer).describe()["pieces"]
    counter = ModelTokenizerCounter(tokenizer, offload_chars=200)
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are a shell. " * 40}]
    misses = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"run step {turn}: " + "ls -la /tmp " * (5 + turn)})
        counted = await counter.count("chat", {"messages": messages, "tools": TOOLS})
        assert counted is not None and list(counted.ids or ()) == tokenizer.chat_ids(messages, TOOLS)
        misses.append(counter.describe()["cache_misses"])
        messages.append({"role": "assistant", "content": f"done {turn}"})
    new_per_turn = [b - a for a, b in itertools.pairwise(misses)]
    # the two messages added, the pieces they bring, and the whole prompt's key (never seen before)
    assert max(new_per_turn) <= 5 and misses[0] >= 4


async def test_what_it_cannot_render_falls_through_to_the_next_counter(tokenizer: ModelTokenizer) -> None:
    estimator = PromptEstimator()
    counter = ModelTokenizerCounter(tokenizer)
    estimator.configure("m", [counter])
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert (await estimator.count("chat", image, "m")).source == SOURCE_ESTIMATE
    assert counter.unsupported == 1
    assert (await estimator.count("chat", {"messages": [{"role": "user", "content": "hi"}]}, "m")).source == "model"
