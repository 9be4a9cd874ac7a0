"""A model's own tokenizer files: what is read, and how chats and completions are tokenized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
