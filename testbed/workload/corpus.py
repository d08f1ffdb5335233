"""The bundled real content the workload is built from (see ``data/NOTICE.md``).

Loaded from package data, so the workload runs wherever the package is installed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

_PACKAGE = "testbed.workload"
_PLACEHOLDER = re.compile(r"\{\{#([^#{}]+)#\}\}")


@dataclass(frozen=True)
class DifyNode:
    """One Dify LLM node: its prompt texts verbatim, ``{{#...#}}`` placeholders unfilled."""

    app_name: str
    node_id: str
    source: str
    system: str
    record: dict[str, Any]

    def fill_system(self, values: dict[str, str]) -> str:
        """The system prompt with every placeholder replaced (each must have a value)."""
        return fill_placeholders(self.system, values)


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]


def fill_placeholders(template: str, values: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"no value for placeholder {{{{#{name}#}}}}")
        return values[name]

    return _PLACEHOLDER.sub(replace, template)


def placeholders(template: str) -> list[str]:
    return _PLACEHOLDER.findall(template)


def _read_text(name: str) -> str:
    path = resources.files(_PACKAGE).joinpath("data")
    for part in name.split("/"):
        path = path.joinpath(part)
    return path.read_text(encoding="utf-8")


@cache
def dify_nodes() -> dict[tuple[str, str], DifyNode]:
    """The bundled Dify nodes by ``(app_name, node_id)`` (node ids repeat across apps)."""
    nodes: dict[tuple[str, str], DifyNode] = {}
    for line in _read_text("dify_prompts.jsonl").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        system = next((m["text"] for m in record["messages"] if m["role"] == "system"), "")
        node = DifyNode(record["app_name"], record["node_id"], record["source"], system, record)
        nodes[(node.app_name, node.node_id)] = node
    return nodes


def dify_node(app_name: str, node_id: str) -> DifyNode:
    return dify_nodes()[(app_name, node_id)]


@cache
def _tools(suite: str) -> str:
    return _read_text(f"tools/{suite}.json")


def tool_suite(suite: str) -> list[dict[str, Any]]:
    """A fresh copy of one BFCL suite as an OpenAI ``tools`` list, in the file's order."""
    tools: list[dict[str, Any]] = json.loads(_tools(suite))
    return tools


@cache
def questions() -> tuple[Question, ...]:
    """The bundled MT-bench questions (2 user turns each), in file order."""
    out = []
    for line in _read_text("mt_bench_questions.jsonl").splitlines():
        if line.strip():
            record = json.loads(line)
            out.append(Question(record["question_id"], record["category"], tuple(record["turns"])))
    return tuple(out)


@cache
def knowledge_passages() -> tuple[str, ...]:
    """A small knowledge base for the RAG scenario: paragraphs of the bundled texts.

    Paragraphs of the Dify prompts (without placeholders), the MT-bench turns and the tool
    descriptions: real prose of the sizes a knowledge-base chunker produces (a few dozen to a
    few hundred tokens).
    """
    passages: list[str] = []
    for node in dify_nodes().values():
        for message in node.record["messages"]:
            for paragraph in re.split(r"\n\s*\n", message["text"]):
                paragraph = paragraph.strip()
                if 80 <= len(paragraph) <= 1200 and "{{" not in paragraph:
                    passages.append(paragraph)
    for question in questions():
        passages.extend(turn.strip() for turn in question.turns if len(turn.strip()) >= 80)
    for suite in ("message_api", "ticket_api"):
        for tool in tool_suite(suite):
            function = tool["function"]
            passages.append(f"{function['name']}: {function['description']}")
    return tuple(dict.fromkeys(passages))
