"""A model's own tokenizer files: what is read, and how chats and completions are tokenized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from backends.tokenization import (
    ChatOptions,
    ModelTokenizer,
    TokenizerLoadError,
    UnsupportedPrompt,
    tokenizer_directory,
)
from tests.real_vllm.tiny_model import BOS


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_chats_carry_one_bos_from_the_template_and_completions_get_it_from_the_tokenizer(
    tiny_model_dir: Path,
) -> None:
    tok = ModelTokenizer.load(tiny_model_dir)
    bos = tok.tokenizer.token_to_id(BOS)
    chat = tok.chat_ids([{"role": "user", "content": "hi"}])
    assert chat[0] == bos and chat.count(bos) == 1  # add_special_tokens=False for chats, as vLLM
    assert tok.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    completion = tok.completion_ids("hi")
    assert completion[0] == bos and completion[1:] == tok.encode("hi", add_special_tokens=False)
    assert tok.completion_ids([5, 6, 7]) == [5, 6, 7]


def test_options_that_change_the_prompt(tiny_model_dir: Path) -> None:
    tok = ModelTokenizer.load(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = tok.chat_ids(messages)
    without = tok.chat_ids(messages, options=ChatOptions.of({"add_generation_prompt": False}))
    assert len(without) < len(with_prompt)
    with pytest.raises(UnsupportedPrompt):
        ChatOptions.of({"chat_template": "{{ messages }}"})  # a per-request template: ask the engine


def test_add_special_tokens_puts_the_tokenizers_bos_before_the_templates(tiny_model_dir: Path) -> None:
    """A chat request's `add_special_tokens: true` (and vLLM's Responses renderer, which always
    passes it) tokenizes the rendered template with the tokenizer's BOS too: two BOS tokens."""
    tok = ModelTokenizer.load(tiny_model_dir)
    bos = tok.tokenizer.token_to_id(BOS)
    messages = [{"role": "user", "content": "hi"}]
    plain = tok.chat_ids(messages)
    special = tok.chat_ids(messages, options=ChatOptions.of({"add_special_tokens": True}))
    assert special == [bos, *plain]


def test_named_templates_pick_tool_use_when_tools_are_given(model_copy: Path) -> None:
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ModelTokenizer.load(model_copy)
    tool = [{"type": "function", "function": {"name": "f"}}]
    assert (tok.render_chat([]), tok.render_chat([], tool)) == ("plain", "tools")


def test_chat_template_jinja_file_wins(model_copy: Path) -> None:
    (model_copy / "chat_template.jinja").write_text("{{ bos_token }}jinja file")
    assert ModelTokenizer.load(model_copy).render_chat([]) == f"{BOS}jinja file"


def test_explicit_add_bos_token_rebuilds_the_post_processor(model_copy: Path) -> None:
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    (model_copy / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    tok = ModelTokenizer.load(model_copy)
    assert tok.completion_ids("hi") == tok.encode("hi", add_special_tokens=False)  # as transformers 5 does


def test_unusable_paths(tmp_path: Path) -> None:
    assert tokenizer_directory(tmp_path) is None
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        ModelTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError):
        ModelTokenizer.load(tmp_path / "tokenizer.json")


def test_a_tokenizer_without_chat_template_cannot_count_chats(tiny_model_dir: Path) -> None:
    tok = ModelTokenizer(ModelTokenizer.load(tiny_model_dir).tokenizer)
    assert not tok.has_chat_template
    with pytest.raises(UnsupportedPrompt, match="no chat template"):
        tok.chat_ids([{"role": "user", "content": "x"}])


def _chatml_tokenizer(pre_tokenizer: Any, decoder: Any) -> ModelTokenizer:
    """A small BPE with ChatML's added tokens and template, trained here on a few sentences."""
    from tokenizers import Tokenizer, models, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], show_progress=False
    )
    hf.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, hi there"] * 50, trainer)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return ModelTokenizer(hf, {"default": template})


@pytest.mark.parametrize("special", [False, True])
def test_piece_by_piece_ids_are_the_whole_encodes_ids(tiny_model_dir: Path, special: bool) -> None:
    """The rendered chat cut at the added tokens, each piece encoded alone (or taken from the cache),
    gives the ids of encoding the rendered text whole: over random conversations, growing turn by
    turn with one cache, special tokens or not."""
    import random

    from policies.estimate import _IdCache

    tok = ModelTokenizer.load(tiny_model_dir)
    assert tok.pieces is not None
    rng = random.Random(7)
    alphabet = "abc xyz\n\t  <|>ü東京{}[]()_.,:;'\"0123456789"
    options = ChatOptions(add_special_tokens=special)
    for _ in range(20):
        cache = _IdCache(1_000_000)
        messages: list[dict[str, Any]] = []
        for _ in range(rng.randrange(1, 6)):
            role = rng.choice(["system", "user", "assistant", "user"])
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
            if rng.random() < 0.2:  # a client that writes an added token: the engine reads it as one too
                text = text[:10] + rng.choice(["<|im_start|>", "<|im_end|>", BOS]) + text[10:]
            messages.append({"role": role, "content": text})
            whole = tok.encode(tok.render_chat(messages, None, options), add_special_tokens=special)
            assert list(tok.chat_ids(messages, None, options, cache)) == whole


def test_a_tokenizer_whose_pieces_differ_from_the_whole_is_encoded_whole() -> None:
    """SentencePiece-style pre-tokenizers that prepend a space to the text's first word only would
    give a piece that starts a message a word of its own: the check at load time finds it, and such a
    tokenizer is encoded whole (same ids, no piece cache)."""
    from tokenizers import decoders, pre_tokenizers

    from policies.estimate import _IdCache

    byte_level = _chatml_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    assert byte_level.pieces is not None
    first_only = _chatml_tokenizer(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"), decoders.Metaspace()
    )
    assert first_only.pieces is None
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi there"}]
    text = first_only.render_chat(messages)
    assert first_only.chat_ids(messages, cache=_IdCache(1000)) == first_only.encode(text, add_special_tokens=False)
