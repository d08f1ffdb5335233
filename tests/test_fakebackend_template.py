"""The Python chat template against the Jinja source a real vLLM would be given."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2 import sandbox as jinja2_sandbox

from proxy.enginemodel.chat_template import (
    DEFAULT_SYSTEM_PROMPT,
    QWEN_STYLE_CHAT_TEMPLATE,
    ChatTemplateError,
    normalize_messages,
    normalize_tools,
    render_chat,
)


def hf_tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' chat-template tojson override.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def compiled_template() -> Any:
    # transformers' environment: sandboxed, trim_blocks and lstrip_blocks on.
    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = hf_tojson
    return env.from_string(QWEN_STYLE_CHAT_TEMPLATE)


def render_jinja(messages: Any, tools: Any = None, add_generation_prompt: bool = True) -> str:
    """What transformers' apply_chat_template renders from vLLM's preprocessed input."""
    return str(
        compiled_template().render(
            messages=normalize_messages(messages),
            tools=normalize_tools(tools),
            add_generation_prompt=add_generation_prompt,
        )
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}, "strict": True}}
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "user only": ([{"role": "user", "content": "Hi"}], None),
    "system and user": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "multi turn": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ],
        None,
    ),
    "tools without system": ([{"role": "user", "content": "Weather?"}], [WEATHER, SEARCH]),
    "tools with system": (
        [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": "Paris?"}],
        [WEATHER],
    ),
    "tool call and results": (
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rainy"}]},
            {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
        ],
        [WEATHER],
    ),
    "assistant text with tool call": (
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"},
        ],
        [WEATHER],
    ),
    "tool message first": ([{"role": "tool", "content": "orphan result"}], None),
    "multiple system messages": (
        [
            {"role": "system", "content": "first"},
            {"role": "user", "content": "a"},
            {"role": "system", "content": "second"},
            {"role": "user", "content": "b"},
        ],
        [SEARCH],
    ),
    "list content and unicode": (
        [
            {"role": "system", "content": [{"type": "text", "text": "规则一"}, {"type": "text", "text": "rule 2"}]},
            {"role": "user", "content": [{"type": "text", "text": "你好 🎉"}, "plain part"]},
        ],
        None,
    ),
    "empty tool_calls and developer role": (
        [
            {"role": "developer", "content": "ignored by this template"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "tool_calls": []},
        ],
        None,
    ),
    "bad and empty arguments": (
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "a", "arguments": "{not json"}},
                    {"type": "function", "function": {"name": "b", "arguments": ""}},
                    {"type": "function", "function": {"name": "c", "arguments": "[1, 2]"}},
                    {"type": "function", "function": {"name": "d", "arguments": {"already": "dict"}}},
                ],
            },
        ],
        [],
    ),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_python_and_jinja_render_identically(name: str, add_generation_prompt: bool) -> None:
    messages, tools = CONVERSATIONS[name]
    assert render_chat(messages, tools, add_generation_prompt) == render_jinja(messages, tools, add_generation_prompt)


text = st.text(st.characters(codec="utf-8"), max_size=30)
arguments = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), text, st.booleans()), max_size=3)
tool_call = st.builds(
    lambda name, args, raw: {
        "id": "c",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args) if raw else args},
    },
    st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    arguments,
    st.booleans(),
)
content = st.one_of(st.none(), text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), max_size=3))
message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, content),
    st.builds(lambda c: {"role": "system", "content": c}, content),
    st.builds(lambda c: {"role": "assistant", "content": c}, content),
    st.builds(
        lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
        content,
        st.lists(tool_call, max_size=2),
    ),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "c", "content": c}, content),
)
tool = st.builds(
    lambda name, desc, props: {
        "type": "function",
        "function": {
            **({"description": desc} if desc is not None else {}),
            "name": name,
            "parameters": {"type": "object", "properties": props},
        },
    },
    st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    st.none() | text,
    st.dictionaries(st.text(max_size=6), st.just({"type": "string"}), max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=8), st.none() | st.lists(tool, max_size=3), st.booleans())
def test_random_conversations_render_identically(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> None:
    assert render_chat(messages, tools, add_generation_prompt) == render_jinja(messages, tools, add_generation_prompt)


class TestRendering:
    def test_default_system_prompt_and_generation_prompt(self) -> None:
        assert render_chat([{"role": "user", "content": "Hi"}]) == (
            f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )

    def test_tool_block_layout(self) -> None:
        out = render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], [SEARCH])
        assert out.startswith(
            "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            '{"type": "function", "function": {"name": "search", "description": null, '
            '"parameters": {"type": "object"}, "strict": true}}\n</tools>\n\n'
        )
        assert (
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' in out
        )

    def test_tool_call_history_is_rendered_like_generated_text(self) -> None:
        out = render_chat([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [CALL]}], [WEATHER])
        assert (
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n"
        ) in out

    def test_consecutive_tool_results_share_one_user_turn(self) -> None:
        out = render_chat(CONVERSATIONS["tool call and results"][0], [WEATHER])
        assert (
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n"
            "</tool_response><|im_end|>\n"
        ) in out

    def test_continue_final_message_leaves_the_turn_open(self) -> None:
        out = render_chat(
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}],
            continue_final_message=True,
        )
        assert out.endswith("<|im_start|>assistant\nThe answer is")


class TestNormalization:
    def test_arguments_strings_become_objects(self) -> None:
        (_, msg) = normalize_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}])
        assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
        assert msg["content"] == ""
        assert CALL["function"]["arguments"] == '{"city":"Paris"}'  # input untouched

    def test_reformatted_arguments_render_the_same(self) -> None:
        compact = render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}])
        spaced_call = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        spaced = render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [spaced_call]}])
        assert compact == spaced

    def test_tool_fields_follow_vllm_model_dump_order(self) -> None:
        tool = {"function": {"parameters": {"b": 1, "a": 2}, "strict": False, "name": "f"}, "type": "function"}
        (dumped,) = normalize_tools([tool]) or []
        assert list(dumped) == ["type", "function"]
        assert list(dumped["function"]) == ["name", "description", "parameters", "strict"]
        assert list(dumped["function"]["parameters"]) == ["b", "a"]  # inner order kept as received

    @pytest.mark.parametrize(
        "messages",
        [
            [],
            [{"content": "no role"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": 5}],
            [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}],
        ],
    )
    def test_invalid_messages_raise(self, messages: list[dict[str, Any]]) -> None:
        with pytest.raises(ChatTemplateError):
            render_chat(messages)

    @pytest.mark.parametrize(
        "tools",
        [[{"type": "function"}], [{"type": "retrieval", "function": {"name": "x"}}], [{"function": {"name": 3}}]],
    )
    def test_invalid_tools_raise(self, tools: list[dict[str, Any]]) -> None:
        with pytest.raises(ChatTemplateError):
            render_chat([{"role": "user", "content": "x"}], tools)
