"""A model's own tokenizer, from the files its engine loads: `tokenizer.json` and the chat template.

Why: admission, context checks and both prefix indexes need the prompt's length and ids *as the
engine counts them*. tiktoken's cl100k is off by up to 2.3x for other vocabularies (CJK worst), so a
pool whose model directory is on this machine (or that names a `tokenizer:` path) counts with the
model's `tokenizer.json` through the `tokenizers` library (Rust, releases the GIL, so the caller may
run it in a thread) and renders chats with the model's template (`backends/chat_template.py`).

What is read, in the order Hugging Face's loader uses (vLLM loads tokenizers through it):
- `tokenizer.json`, with its post-processor (BOS/EOS) rebuilt from `add_bos_token` /
  `add_eos_token` when `tokenizer_config.json` sets either, as transformers 5 does;
- the chat template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string,
  or named templates: `tool_use` when the request has tools, else `default`), else
  `chat_template.json`;
- the named special tokens (`bos_token`, `eos_token`, ...) from `tokenizer_config.json`, else
  `special_tokens_map.json`.

Chats are tokenized without special tokens (the template writes them), completions and embeddings
inputs with them, as vLLM's defaults do (`add_special_tokens` false for chat, true otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

from backends.chat_template import ChatTemplate, UnsupportedPrompt

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerLoadError(ValueError):
    """The files at a path are not a usable tokenizer (missing tokenizer.json, bad JSON, ...)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken map."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def tokenizer_directory(path: str | Path) -> Path | None:
    """The directory holding `tokenizer.json` for `path` (a directory or the file); None if absent."""
    candidate = Path(path).expanduser()
    if candidate.is_file() and candidate.name == "tokenizer.json":
        return candidate.parent
    if (candidate / "tokenizer.json").is_file():
        return candidate
    return None


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What of a chat request, besides messages and tools, changes the rendered prompt."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's chat default; its Responses renderer passes true
    documents: Any = None
    template_kwargs: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ChatOptions:
        if body.get("chat_template") is not None:
            raise UnsupportedPrompt("a per-request chat_template")
        kwargs = body.get("chat_template_kwargs")
        return cls(
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            add_special_tokens=bool(body.get("add_special_tokens", False)),
            documents=body.get("documents"),
            template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )


class ModelTokenizer:
    """Counts prompts as vLLM does for one model. Thread-safe; every method is synchronous."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        *,
        name: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        self._templates = {key: ChatTemplate(source, self.special_tokens) for key, source in (templates or {}).items()}

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        directory = tokenizer_directory(path)
        if directory is None:
            raise TokenizerLoadError(f"{path}: no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerLoadError(f"{directory / 'tokenizer.json'}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        if not special:
            legacy = _read_json(directory / "special_tokens_map.json")
            special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(legacy.get(name)))}
        _apply_bos_eos(tokenizer, config, special)
        return cls(tokenizer, _templates(directory, config), special, name=str(directory))

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def template(self, with_tools: bool) -> ChatTemplate:
        if not self._templates:
            raise UnsupportedPrompt(f"{self.name}: no chat template")
        if with_tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise UnsupportedPrompt(f"{self.name}: several chat templates and none named `default`")

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encoded]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None, options: ChatOptions | None = None
    ) -> str:
        options = options or ChatOptions()
        if tools is not None and not isinstance(tools, list):
            raise UnsupportedPrompt("tools is not a list")
        template = self.template(bool(tools))
        return template.render(
            messages,
            tools,
            add_generation_prompt=options.add_generation_prompt and not options.continue_final_message,
            continue_final_message=options.continue_final_message,
            documents=options.documents,
            extra=options.template_kwargs,
        )

    def chat_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None, options: ChatOptions | None = None
    ) -> list[int]:
        options = options or ChatOptions()
        return self.encode(self.render_chat(messages, tools, options), add_special_tokens=options.add_special_tokens)

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]


def _templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    value = config.get("chat_template")
    if value is None:
        value = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        return {
            str(item["name"]): str(item["template"])
            for item in value
            if isinstance(item, Mapping) and "name" in item and "template" in item
        }
    return {}


def _apply_bos_eos(tokenizer: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]) -> None:
    """transformers 5 rebuilds the post-processor when add_bos_token / add_eos_token are explicit."""
    if "add_bos_token" not in config and "add_eos_token" not in config and tokenizer.post_processor is not None:
        return
    add_bos = bool(config.get("add_bos_token", False)) and "bos_token" in special
    add_eos = bool(config.get("add_eos_token", False)) and "eos_token" in special
    pieces, tokens = [], []
    if add_bos:
        bos = special["bos_token"]
        pieces.append(f"{bos}:0")
        tokens.append((bos, tokenizer.token_to_id(bos)))
    pieces.append("$A:0")
    if add_eos:
        eos = special["eos_token"]
        pieces.append(f"{eos}:0")
        tokens.append((eos, tokenizer.token_to_id(eos)))
    known = [(text, token_id) for text, token_id in tokens if token_id is not None]
    single = " ".join(pieces)
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=known)
