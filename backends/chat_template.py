"""A model's Jinja chat template, rendered the way vLLM renders it, so prompt counts match the engine.

vLLM (0.32, `vllm/renderers/hf.py` and `chat_utils.py`) turns an OpenAI `messages` list into a
"conversation" and hands it to Hugging Face's `apply_chat_template`. What matters for token counts,
reproduced here:

- The Jinja environment: sandboxed, `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
  a `tojson` filter that is `json.dumps` (Jinja's own escapes HTML and sorts keys), the globals
  `raise_exception` and `strftime_now`, and a `{% generation %}` block that renders its body.
  Variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's named special
  tokens (`bos_token`, `eos_token`, ...) and the request's `chat_template_kwargs`.
- The content format: a template that loops over a message's content gets parts
  (`[{"type": "text", "text": ...}]`, "openai"), any other gets one string, text parts joined by "\\n"
  ("string"); vLLM detects which from the template's syntax tree, and so does `content_format`.
- Messages: `content: null` becomes empty; assistant `tool_calls` arguments are parsed from their JSON
  string into a mapping (`{}` when empty or not an object); a `tool` message's text parts become one
  string; `developer` becomes `system` when the template does not mention it.
- Tools: each as vLLM's request model dumps it, `{"type": "function", "function": {"name",
  "description", "parameters"[, "strict"]}}`, unknown keys dropped.

Anything else (images, audio, a per-request template) raises `UnsupportedPrompt`: the caller then
asks the engine instead of guessing.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
