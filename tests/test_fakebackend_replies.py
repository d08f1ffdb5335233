"""The reply policy, prompt parsing, tool-call parsing/streaming and tokenizers."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.enginemodel.chat_template import render_chat
from proxy.enginemodel.tokenizer import HFTokenizer, TiktokenChatTokenizer, load_tokenizer
from testbed.fakevllm.chatml import parse_prompt
from testbed.fakevllm.detokenizer import token_text_deltas
from testbed.fakevllm.replies import (
    SUMMARY_HEADER,
    TextReply,
    ToolCallReply,
    plan_reply,
    reply_for_prompt,
    tool_call_for,
)
from testbed.fakevllm.toolcalls import parse_output, stream_deltas

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "optional": {"type": "string"},
            },
            "required": ["city", "unit", "days", "hourly", "tags"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


def rendered(*turns: tuple[str, Any], tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt the fake backend's template makes of (role, content) turns."""
    return render_chat([{"role": role, "content": content} for role, content in turns], tools)


TOKENIZER = TiktokenChatTokenizer()


class TestPlainText:
    def test_deterministic_and_varied(self) -> None:
        a = reply_for_prompt(rendered(("user", "What is APC?")))
        assert a == reply_for_prompt(rendered(("user", "What is APC?")))
        others = {reply_for_prompt(rendered(("user", f"question {i}"))) for i in range(20)}
        assert len(others) == 20

    def test_twenty_to_sixty_words_in_sentences(self) -> None:
        for i in range(50):
            words = reply_for_prompt(rendered(("user", f"q{i}"))).split()
            assert 20 <= len(words) <= 60
            assert words[0][0].isupper() and words[-1].endswith(".")

    def test_depends_on_the_last_turn_only(self) -> None:
        a = reply_for_prompt(rendered(("system", "A"), ("user", "same question")))
        b = reply_for_prompt(
            rendered(("system", "B"), ("user", "earlier"), ("assistant", "x"), ("user", "same question"))
        )
        assert a == b

    def test_max_tokens_truncates(self) -> None:
        prompt = rendered(("user", "long answer please"))
        assert len(TOKENIZER.encode(reply_for_prompt(prompt, 5))) <= 5
        assert reply_for_prompt(prompt).startswith(reply_for_prompt(prompt, 5))

    def test_raw_text_prompt_is_one_user_turn(self) -> None:
        assert isinstance(plan_reply("Once upon a time"), TextReply)


class TestToolCalls:
    def test_user_turn_with_tools_gets_a_tool_call(self) -> None:
        reply = plan_reply(rendered(("user", "Weather in Paris tomorrow?"), tools=[WEATHER]))
        assert isinstance(reply, ToolCallReply)
        assert reply.name == "get_weather"
        args = reply.arguments
        assert list(args) == ["city", "unit", "days", "hourly", "tags"]
        assert args["unit"] in ("c", "f") and isinstance(args["days"], int) and isinstance(args["hourly"], bool)
        assert isinstance(args["city"], str) and args["city"] in "Weather in Paris tomorrow?"

    def test_tool_call_text_is_hermes_format(self) -> None:
        text = reply_for_prompt(rendered(("user", "Weather?"), tools=[WEATHER]))
        match = re.fullmatch(r"<tool_call>\n(\{.*\})\n</tool_call>", text, re.DOTALL)
        assert match is not None
        payload = json.loads(match.group(1))
        assert payload["name"] == "get_weather"

    def test_generated_call_renders_back_byte_identical(self) -> None:
        # What the model generated is exactly what the template renders for it in history.
        prompt = rendered(("user", "Weather in Rome?"), tools=[WEATHER])
        reply = plan_reply(prompt)
        assert isinstance(reply, ToolCallReply)
        call = {
            "id": "x",
            "type": "function",
            "function": {"name": reply.name, "arguments": json.dumps(reply.arguments)},
        }
        history = render_chat(
            [
                {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
            ],
            [WEATHER],
        )
        assert history == prompt + reply.text + "<|im_end|>\n" + "<|im_start|>assistant\n"

    def test_tool_choice_is_deterministic_and_spread(self) -> None:
        tools = [WEATHER, NOOP]
        names = {plan_reply(rendered(("user", f"ask {i}"), tools=tools)).name for i in range(30)}  # type: ignore[union-attr]
        assert names == {"get_weather", "noop"}

    def test_tool_results_get_a_text_answer(self) -> None:
        prompt = render_chat(
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "noop"}}]},
                {"role": "tool", "content": "sunny"},
            ],
            [NOOP],
        )
        assert isinstance(plan_reply(prompt), TextReply)

    def test_named_tool(self) -> None:
        call = tool_call_for(rendered(("user", "x"), tools=[WEATHER, NOOP]), "noop")
        assert call == ToolCallReply("noop", {})


class TestSummaries:
    @pytest.mark.parametrize("ask", ["Please SUMMARIZE the chat", "Give me a summary.", "请给出摘要", "总结一下"])
    def test_summary_requests(self, ask: str) -> None:
        prompt = rendered(
            ("system", "You are helpful."),
            ("user", "I need a trip to Paris. Budget is small."),
            ("assistant", "Paris is lovely in spring! Trains are cheap."),
            ("user", ask),
            tools=[WEATHER],
        )
        text = reply_for_prompt(prompt)
        assert text.splitlines() == [
            SUMMARY_HEADER,
            "- user: I need a trip to Paris.",
            "- assistant: Paris is lovely in spring!",
        ]

    def test_summary_of_tool_turns_and_pasted_conversations(self) -> None:
        prompt = render_chat(
            [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "noop", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "Sunny all day. Warm."},
                {"role": "user", "content": "summarize"},
            ],
            [NOOP],
        )
        assert reply_for_prompt(prompt).splitlines()[1:] == [
            "- user: Weather?",
            "- assistant called noop",
            "- tool result: Sunny all day.",
        ]
        pasted = rendered(("user", "Summarize this:\nAlice: hi there. more\nBob: hello."))
        assert reply_for_prompt(pasted).splitlines()[1:] == ["- Alice: hi there.", "- Bob: hello."]

    def test_summary_respects_max_tokens(self) -> None:
        prompt = rendered(*[("user", f"Sentence number {i} is here.") for i in range(30)], ("user", "summarize"))
        assert len(TOKENIZER.encode(reply_for_prompt(prompt, 12))) <= 12


class TestPromptParsing:
    def test_turns_tools_and_open_turn(self) -> None:
        view = parse_prompt(rendered(("system", "S"), ("user", "U"), tools=[WEATHER, NOOP]))
        assert [t.role for t in view.turns] == ["system", "user", "assistant"]
        assert [t["name"] for t in view.tools] == ["get_weather", "noop"]
        assert view.last_turn is not None and view.last_turn.content == "U"
        assert [t.role for t in view.history] == ["system"]


class TestToolCallParsing:
    TEXT = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": "日本", "b": [1, 2]}}\n</tool_call>'

    def test_hermes(self) -> None:
        parsed = parse_output(self.TEXT, "auto")
        assert parsed.content == "Sure."
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": "日本", "b": [1, 2]}')]

    def test_hermes_multiple_calls_and_no_content(self) -> None:
        two = (
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
        )
        parsed = parse_output(two, "auto")
        assert parsed.content is None
        assert [c.name for c in parsed.tool_calls] == ["a", "b"]

    @pytest.mark.parametrize("text", ['<tool_call>\n{"name": "f", "argu', "<tool_call>{}</tool_call>", "plain"])
    def test_unparseable_is_content(self, text: str) -> None:
        parsed = parse_output(text, "auto")
        assert parsed.content == text and not parsed.tool_calls

    def test_named_and_required(self) -> None:
        named = parse_output('{"q": "x"}', "named", "search")
        assert named.content == "" and named.tool_calls[0].arguments == '{"q": "x"}'
        required = parse_output('[{"name": "s", "parameters": {"q":"x"}}]', "required")
        assert required.tool_calls[0].name == "s" and required.tool_calls[0].arguments == '{"q": "x"}'
        assert parse_output("anything", "none").content == "anything"

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(0, 200), max_size=12), st.sampled_from(["auto", "named", "required"]))
    def test_stream_deltas_reassemble_to_the_parsed_result(self, cuts: list[int], mode: str) -> None:
        text = {
            "auto": self.TEXT,
            "named": '{"a": "日本"}',
            "required": '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]',
        }[mode]
        points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
        pieces = [text[a:b] for a, b in itertools.pairwise(points)] + [""]
        parsed = parse_output(text, mode, "f")  # type: ignore[arg-type]
        ids = [f"id{i}" for i in range(len(parsed.tool_calls))]
        content, calls = "", [{"name": "", "arguments": "", "id": None} for _ in ids]
        for delta in stream_deltas(parsed, pieces, ids):
            if delta is None:
                continue
            content += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                call = calls[entry["index"]]
                call["id"] = entry.get("id", call["id"])
                call["name"] += entry.get("function", {}).get("name", "")
                call["arguments"] += entry.get("function", {}).get("arguments", "")
        assert content == (parsed.content or "")
        assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
            (i, c.name, c.arguments) for i, c in zip(ids, parsed.tool_calls, strict=True)
        ]


class TestTokenizers:
    def test_chatml_markers_are_single_special_tokens(self) -> None:
        ids = TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n")
        assert ids[0] == 100264 and ids[-2] == 100265 == TOKENIZER.eos_token_id
        assert TOKENIZER.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"

    @settings(max_examples=200, deadline=None)
    @given(st.text(st.characters(codec="utf-8"), max_size=40))
    def test_stream_deltas_concatenate_to_the_text(self, text: str) -> None:
        ids = TOKENIZER.encode(text)
        deltas = token_text_deltas(TOKENIZER, ids)
        assert len(deltas) == len(ids)
        assert "".join(deltas) == text

    @pytest.fixture
    def hf_tokenizer_file(self, tmp_path: Path) -> Path:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(["hello world, the user and the assistant talk"] * 20, trainer)
        tok.decoder = decoders.ByteLevel()
        path = tmp_path / "tokenizer.json"
        tok.save(str(path))
        return path

    def test_hf_tokenizer_json(self, hf_tokenizer_file: Path) -> None:
        tok = load_tokenizer(hf_tokenizer_file.parent)
        assert isinstance(tok, HFTokenizer)
        text = "<|im_start|>user\nhello world<|im_end|>\n"
        ids = tok.encode(text)
        assert ids[0] == tok.encode("<|im_start|>")[0] and tok.eos_token_id in ids
        assert tok.decode(ids) == text
        assert "".join(token_text_deltas(tok, tok.encode("hello wörld"))) == "hello wörld"

    def test_hf_tokenizer_needs_an_end_token(self, hf_tokenizer_file: Path) -> None:
        with pytest.raises(ValueError):
            HFTokenizer(hf_tokenizer_file, eos_token="</s>")
