"""The fake model: a deterministic reply for a rendered prompt.

A pure function of the prompt *text* (not of structured messages), so the same policy can
drive a real vLLM through a logits processor that only sees the decoded prompt. Policy, on
the last turn before the generation prompt:

1. Summary request: the last turn contains "summar" (any case), "摘要" or "总结". Reply with a
   compact summary built from the prompt: the first sentence of each earlier turn (tool calls
   named, tool results abbreviated). If the request carries the conversation inside that one
   turn, the first sentence of each of its later lines is used instead.
2. Tool call: the system block declares tools and the last turn is a user message (not tool
   responses). Reply with one Hermes/Qwen tool call, byte-identical to how the template
   renders it back in history::

       <tool_call>
       {"name": "<tool>", "arguments": {...}}
       </tool_call>

   The tool is chosen by a hash of the user text; required parameters get short values
   derived from the schema (enum member, number, boolean) or from a word of the user text.
3. Otherwise: 20 to 60 words of plain English picked by hashing the last turn, so different
   questions get different but reproducible answers.

``max_tokens`` truncates the reply to that many tokens of the given tokenizer (cl100k with
ChatML markers by default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import xxhash

from proxy.enginemodel import ChatTokenizer, TiktokenChatTokenizer
from testbed.fakevllm.chatml import PromptView, Turn, parse_prompt

SUMMARY_MARKERS = ("summar", "摘要", "总结")
TOOL_CALL_OPEN = "<tool_call>"
MIN_WORDS = 20
MAX_WORDS = 60
SUMMARY_HEADER = "Summary of the conversation so far:"

# Plain words the fake model strings into sentences.
_VOCABULARY = (
    "the",
    "system",
    "answer",
    "request",
    "model",
    "cache",
    "prefix",
    "token",
    "block",
    "reply",
    "value",
    "result",
    "data",
    "service",
    "user",
    "question",
    "context",
    "detail",
    "example",
    "record",
    "report",
    "option",
    "update",
    "version",
    "server",
    "client",
    "message",
    "process",
    "config",
    "window",
    "memory",
    "history",
    "session",
    "routing",
    "budget",
    "metric",
    "latency",
    "throughput",
    "replica",
    "backend",
    "stream",
    "chunk",
    "batch",
    "queue",
    "layer",
    "vector",
    "quickly",
    "clearly",
    "simply",
    "carefully",
    "usually",
    "often",
    "mostly",
    "nearly",
    "always",
    "rarely",
    "is",
    "are",
    "was",
    "can",
    "will",
    "should",
    "may",
    "keeps",
    "returns",
    "holds",
    "shows",
    "uses",
    "needs",
    "makes",
    "gives",
    "stable",
    "large",
    "small",
    "fresh",
    "early",
    "later",
    "exact",
    "shared",
    "simple",
    "common",
    "useful",
    "careful",
    "and",
    "but",
    "so",
    "then",
    "also",
    "with",
    "from",
    "for",
    "into",
    "over",
    "after",
    "before",
    "about",
    "within",
)
_WORD_RE = re.compile(r"\w+", re.UNICODE)
_SENTENCE_END_RE = re.compile(r"(?<=[.!?。！？])\s|\n")
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class TextReply:
    text: str


@dataclass(frozen=True)
class ToolCallReply:
    name: str
    arguments: dict[str, Any]

    @property
    def text(self) -> str:
        return render_tool_call(self.name, self.arguments)


Reply = TextReply | ToolCallReply


def reply_for_prompt(prompt_text: str, max_tokens: int | None = None, *, tokenizer: ChatTokenizer | None = None) -> str:
    """The raw text the fake model generates for ``prompt_text`` (before the end token)."""
    text = plan_reply(prompt_text).text
    if max_tokens is None:
        return text
    return truncate_to_tokens(text, max_tokens, tokenizer or _default_tokenizer())


def plan_reply(prompt_text: str) -> Reply:
    """The reply as a value: plain text, or a tool call with its arguments."""
    view = parse_prompt(prompt_text)
    last = view.last_turn
    if last is None:
        return TextReply(plain_text(prompt_text))
    if is_summary_request(last.content):
        return TextReply(summarize(view))
    if view.tools and last.role == "user" and not last.is_tool_responses:
        tool = view.tools[_hash(last.content) % len(view.tools)]
        return ToolCallReply(tool["name"], fill_arguments(tool.get("parameters"), last.content))
    return TextReply(plain_text(last.content))


def tool_call_for(prompt_text: str, tool_name: str) -> ToolCallReply:
    """The call the fake model makes when a request forces ``tool_name`` (named tool_choice)."""
    view = parse_prompt(prompt_text)
    last = view.last_turn
    seed_text = last.content if last is not None else prompt_text
    for tool in view.tools:
        if tool["name"] == tool_name:
            return ToolCallReply(tool_name, fill_arguments(tool.get("parameters"), seed_text))
    return ToolCallReply(tool_name, {})


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    # Built exactly like the template's history rendering, so regenerated history matches.
    return (
        TOOL_CALL_OPEN
        + '\n{"name": "'
        + name
        + '", "arguments": '
        + json.dumps(arguments, ensure_ascii=False)
        + "}\n</tool_call>"
    )


def is_summary_request(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in SUMMARY_MARKERS)


def plain_text(seed_text: str) -> str:
    """20-60 words in short sentences, chosen by a hash of ``seed_text``."""
    seed = _hash(seed_text)
    count = MIN_WORDS + seed % (MAX_WORDS - MIN_WORDS + 1)
    words: list[str] = []
    sentence_left = 0
    for index in range(count):
        draw = xxhash.xxh64_intdigest(index.to_bytes(4, "little"), seed=seed)
        word = _VOCABULARY[draw % len(_VOCABULARY)]
        if sentence_left == 0:
            word = word.capitalize()
            sentence_left = 6 + (draw >> 32) % 7
        sentence_left -= 1
        if sentence_left == 0 or index == count - 1:
            word += "."
            sentence_left = 0
        words.append(word)
    return " ".join(words)


def summarize(view: PromptView) -> str:
    lines = [SUMMARY_HEADER]
    for turn in view.history:
        line = _summary_line(turn)
        if line:
            lines.append(line)
    if len(lines) == 1 and view.last_turn is not None:
        # The conversation was pasted into the request itself: summarize its later lines.
        for paragraph in view.last_turn.content.split("\n")[1:]:
            sentence = first_sentence(paragraph)
            if sentence:
                lines.append("- " + sentence)
    if len(lines) == 1:
        lines.append("- Nothing to summarize yet.")
    return "\n".join(lines)


def first_sentence(text: str, max_words: int = 20) -> str:
    head = _SENTENCE_END_RE.split(text.strip(), maxsplit=1)[0].strip()
    words = head.split()
    if len(words) > max_words:
        head = " ".join(words[:max_words]) + " ..."
    return head


def fill_arguments(parameters: Any, seed_text: str) -> dict[str, Any]:
    """Short deterministic values for the required parameters of a JSON schema."""
    if not isinstance(parameters, Mapping):
        return {}
    properties = parameters.get("properties")
    required = parameters.get("required")
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        return {}
    arguments: dict[str, Any] = {}
    for key in required:
        if isinstance(key, str) and key in properties:
            arguments[key] = _value_for(properties[key], seed_text, key, depth=0)
    return arguments


def truncate_to_tokens(text: str, max_tokens: int, tokenizer: ChatTokenizer) -> str:
    ids = tokenizer.encode(text)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[: max(max_tokens, 0)]).rstrip("\ufffd")


def _summary_line(turn: Turn) -> str | None:
    if turn.role == "system":
        return None
    if turn.is_tool_responses:
        body = turn.content.removeprefix("<tool_response>").split("</tool_response>")[0]
        return "- tool result: " + first_sentence(body)
    if turn.role == "assistant" and TOOL_CALL_OPEN in turn.content:
        names = []
        for raw in _TOOL_CALL_RE.findall(turn.content):
            try:
                names.append(str(json.loads(raw).get("name")))
            except (json.JSONDecodeError, AttributeError):
                continue
        return "- assistant called " + (", ".join(names) or "a tool")
    sentence = first_sentence(turn.content)
    return f"- {turn.role}: {sentence}" if sentence else None


def _value_for(schema: Any, seed_text: str, key: str, depth: int) -> Any:
    if not isinstance(schema, Mapping):
        return _keyword(seed_text, key)
    draw = _hash(seed_text + "\x00" + key)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[draw % len(enum)]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer":
        return 1 + draw % 9
    if kind == "number":
        return 1 + (draw % 90) / 10
    if kind == "boolean":
        return draw % 2 == 0
    if kind == "null":
        return None
    if kind == "array":
        if depth >= 3:
            return []
        return [_value_for(schema.get("items"), seed_text, key, depth + 1)]
    if kind == "object":
        return fill_arguments(schema, seed_text) if depth < 3 else {}
    return _keyword(seed_text, key)


def _keyword(seed_text: str, key: str) -> str:
    words = [w for w in _WORD_RE.findall(seed_text) if len(w) >= 3]
    if not words:
        return _VOCABULARY[_hash(key) % len(_VOCABULARY)]
    return words[_hash(seed_text + "\x00" + key) % len(words)][:32]


def _hash(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass"))


@lru_cache(maxsize=1)
def _default_tokenizer() -> ChatTokenizer:
    return TiktokenChatTokenizer()
