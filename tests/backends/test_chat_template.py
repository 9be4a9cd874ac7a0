# mypy: disable-error-code="arg-type,index"
"""Chat templates rendered as vLLM renders them (its content-format detection, message and tool
preparation, Hugging Face's Jinja environment); the real-vLLM suite checks the counts end to end."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.tokenization import ChatTemplate, UnsupportedPrompt, normalize_tools, to_conversation

LOOPS_OVER_PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
STRING_CONTENT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(
    ("source", "content_format"),
    [
        pytest.param(STRING_CONTENT, "string", id="string-content"),
        pytest.param(LOOPS_OVER_PARTS, "openai", id="loop-over-message-content"),
        pytest.param(
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
            id="loop-over-an-alias-of-messages",
        ),
        pytest.param(
            "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}",
            "openai",
            id="loop-over-content-variable",
        ),
        pytest.param("{% for t in tools %}{{ t | tojson }}{% endfor %}", "string", id="loop-over-tools-only"),
    ],
)
def test_content_format_detection(source: str, content_format: str) -> None:
    assert ChatTemplate(source).content_format == content_format


def test_text_parts_join_with_newlines_for_string_templates() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ChatTemplate(STRING_CONTENT).render(messages) == "user: a\nb\n"
    assert ChatTemplate(LOOPS_OVER_PARTS).render(messages) == "ab"


def test_tojson_is_json_dumps_not_jinjas_html_escaping() -> None:
    template = ChatTemplate("{{ tools | tojson }}")
    tools = [{"type": "function", "function": {"name": "f", "description": "a <b> & 'c' 天", "parameters": {"z": 1}}}]
    rendered = template.render([], tools)
    assert rendered == json.dumps(normalize_tools(tools), ensure_ascii=False)
    assert "<b>" in rendered and "天" in rendered  # Jinja's own filter would write \\u003c and sort keys


def test_tools_are_dumped_as_vllms_request_model_does() -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "extra": 1}, "other": 2},
        {"type": "function", "function": {"name": "g", "parameters": {"b": 1, "a": 2}, "strict": True}},
    ]
    assert normalize_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": None, "parameters": {"b": 1, "a": 2},
                                          "strict": True}},
    ]  # fmt: skip
    assert list(normalize_tools(tools)[1]["function"]["parameters"]) == ["b", "a"]  # the client's key order
    assert normalize_tools(None) is None


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        pytest.param('{"city": "Paris"}', {"city": "Paris"}, id="json-string"),
        pytest.param("", {}, id="empty"),
        pytest.param("not json", {}, id="malformed"),
        pytest.param("[1, 2]", {}, id="not-an-object"),
        pytest.param({"a": 1}, {"a": 1}, id="already-a-mapping"),
    ],
)
def test_tool_call_arguments_become_mappings(arguments: Any, parsed: dict[str, Any]) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    (message,) = to_conversation([{"role": "assistant", "content": None, "tool_calls": [call]}], "string")
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == parsed


def test_tool_messages_get_one_string_and_developer_becomes_system_when_unsupported() -> None:
    messages = [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": t} for t in "xy"]},
    ]
    conversation = to_conversation(messages, "openai", supports_developer=False)
    assert conversation[0] == {"role": "system", "content": [{"type": "text", "text": "be terse"}]}
    assert conversation[1] == {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}
    assert conversation[2] == {"role": "tool", "content": "x\ny", "tool_call_id": "c"}


def test_non_text_parts_are_not_guessed() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    with pytest.raises(UnsupportedPrompt):
        ChatTemplate(STRING_CONTENT).render([image])


def test_hugging_face_globals_and_generation_blocks() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('x') }}"
        "{% endif %}",
        {"bos_token": "<s>"},
    )
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi>"
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s>hi"
    with pytest.raises(UnsupportedPrompt, match="rejected"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])


def test_continue_final_message_cuts_after_the_final_text() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}</s>{% endfor %}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert template.render(messages, continue_final_message=True) == "[user] q</s>[assistant] The answer is"
