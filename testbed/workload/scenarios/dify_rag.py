"""(a) ``dify_rag``: a Dify basic chatbot with a knowledge base.

Dify's simple prompt transform puts the context prompt *first* in the system message and the
app's instruction (pre-prompt) after it::

    Use the following context as your learned knowledge, inside <context></context> XML tags.
    <context>
    {retrieved chunks: different for every query}
    </context>
    When answer to user: ...
    {the app's long, stable instruction}

so the whole prompt, history included, misses the prefix cache on every request. The
context prompt is Dify's own (node ``1720801890321`` of the bundled data); the instructions
are two real Dify prompts (1.8k and 0.8k tokens). Chunks are paragraphs of the bundled texts
(a few dozen to a few hundred tokens each), ``TOP_K`` per query, ranked by word overlap with
the query like a keyword retriever would. History is re-sent exactly as received.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass, field
from functools import cache

from testbed.workload.corpus import dify_node, fill_placeholders, knowledge_passages
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns, user_turn_count
from testbed.workload.session import Message, Session

NAME = "dify_rag"
TOP_K = 4  # chunks per query (Dify's top_k setting; its UI allows 1-10)
CONTEXT_NODE = ("document chat", "1720801890321")

_WORD = re.compile(r"[a-z0-9]+|[\u4e00-\u9fff]")


@dataclass(frozen=True)
class RagApp:
    app_name: str
    node_id: str
    fills: dict[str, str] = field(default_factory=dict)

    @property
    def instruction(self) -> str:
        return dify_node(self.app_name, self.node_id).fill_system(self.fills)


APPS = (
    RagApp(
        "运营一条龙",
        "1721701419863",
        {
            "1721707099211.output": "喜欢真实的使用体验分享，偏好干货清单和步骤说明，语气轻松。",
            "1721690653676.output": "Dify：开源的大模型应用开发平台\nRAG：检索增强生成",
            "1721651035904.nouns": "知识库、工作流、智能体",
            "1721651035904.style": "热情、亲切、口语化",
        },
    ),
    RagApp(
        "运营一条龙",
        "1721714550947",
        {
            "1721707099211.output": "Practical tips, honest reviews and short punchy sentences.",
            "1721690653676.output": (
                "Dify: an open-source LLM app development platform\nRAG: retrieval-augmented generation"
            ),
            "1721651035904.nouns": "knowledge base, workflow, agent",
            "1721651035904.style": "friendly, energetic and witty",
        },
    ),
)


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


@cache
def _indexed_passages() -> tuple[tuple[str, frozenset[str]], ...]:
    return tuple((p, frozenset(_words(p))) for p in knowledge_passages())


def retrieve(query: str, top_k: int = TOP_K) -> list[str]:
    """The ``top_k`` passages sharing the most words with ``query`` (a pure function of it)."""
    query_words = _words(query)
    scored = []
    for passage, words in _indexed_passages():
        if passage == query.strip():
            continue
        overlap = len(query_words & words) / math.sqrt(len(words) or 1)
        tie = zlib.crc32(f"{query}\x00{passage}".encode())
        scored.append((-overlap, tie, passage))
    scored.sort()
    return [passage for _, _, passage in scored[:top_k]]


class DifyRagSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, user_turn_count(rng), index // len(APPS)))
        self.app = APPS[index % len(APPS)]
        self._context_prompt = dify_node(*CONTEXT_NODE).system
        self._instruction = self.app.instruction

    def system_messages(self, query: str) -> list[Message]:
        context = "\n".join(retrieve(query))
        prompt = fill_placeholders(self._context_prompt, {"context": context})
        return [{"role": "system", "content": f"{prompt}\n\n{self._instruction}"}]


SCENARIO = Scenario(
    NAME,
    "Dify chatbot: retrieved <context> chunks at the top of the system prompt",
    DifyRagSession,
)
