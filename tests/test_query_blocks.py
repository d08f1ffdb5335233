"""A moved block that restates the user's question is re-created before earlier questions."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from proxy.canon import CanonOptions, LearnedVolatility, canonicalize
from proxy.canon.querytemplate import restore_query_blocks, template_of

# The shape of Dify's llm→o1 "执行任务" node: the question first, then the instruction body.
TEMPLATE = (
    '## 问题\n"""{q}"""\n\n## 任务背景\n这是工作流中的一个环节，前面的工作流流程会将问题拆分出 N 个步骤。\n\n'
    "## 任务\n根据问题拆分出的步骤，解答指定步骤的任务。\n\n## 输出\n采用 Markdown 输出解答。"
)
QUESTIONS = [
    "How do I compute the area of a circle with radius 3?",
    "And what is its circumference?",
    "Explain why pi is irrational in simple words.",
    "Give one more example with radius 5, please.",
]


def request(history: list[dict[str, Any]], question: str, template: str = TEMPLATE) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": template.format(q=question)},
            *history,
            {"role": "user", "content": question},
        ],
    }


def conversation(options: CanonOptions, template: str = TEMPLATE) -> list[list[dict[str, Any]]]:
    """Forwarded messages of each turn of one conversation (the app's prompt already learned)."""
    learned = LearnedVolatility()
    for warm in ("Warm-up question number one?", "Warm-up question number two?"):
        canonicalize(request([], warm, template), options, namespace="t", learned=learned)
    history: list[dict[str, Any]] = []
    forwarded = []
    for turn, question in enumerate(QUESTIONS):
        result = canonicalize(request(history, question, template), options, namespace="t", learned=learned)
        forwarded.append(result.body["messages"])
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": f"Answer {turn}."}]
    return forwarded


def test_each_turn_extends_the_previous_turn_answer_included() -> None:
    turns = conversation(CanonOptions())
    for turn, (previous, current) in enumerate(itertools.pairwise(turns)):
        answer = {"role": "assistant", "content": f"Answer {turn}."}
        assert current[: len(previous) + 1] == [*previous, answer]


def test_without_restoring_the_history_diverges_at_the_previous_question() -> None:
    turns = conversation(CanonOptions(restore_query_blocks=False))
    assert turns[1][: len(turns[0])] != turns[0]


def test_restored_blocks_are_the_template_around_each_earlier_question() -> None:
    last = conversation(CanonOptions())[-1]
    restated = [m["content"] for m in last if m["role"] == "system"][1:]
    # The question moves as a whole unit: the heading that introduces it goes along (a "## 问题"
    # left with nothing under it would tell the model of a question that is not there).
    assert restated == [f'## 问题\n"""{q}"""\n' for q in QUESTIONS]
    users = [m["content"] for m in last if m["role"] == "user"]
    assert users == QUESTIONS  # nothing the client sent is changed or dropped


def test_restoring_is_idempotent() -> None:
    last = conversation(CanonOptions())[-1]
    again = canonicalize({"model": "m", "messages": last}, CanonOptions(), namespace="t")
    assert again.body["messages"] == last


@pytest.mark.parametrize(
    ("block", "query", "why"),
    [
        ("Time: 10:01", "1", "a short message can occur in the block by chance"),
        ("see 'thank you very much' " + "x" * 300, "thank you very much", "the rest is no template"),
        ("Q: abcdefgh / abcdefgh", "abcdefgh", "the question occurs twice"),
    ],
)
def test_blocks_that_are_not_a_restatement_are_left_alone(block: str, query: str, why: str) -> None:
    assert template_of(block, query) is None, why
    messages = [
        {"role": "system", "content": "stable"},
        {"role": "user", "content": "an earlier question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "system", "content": block},
        {"role": "user", "content": query},
    ]
    assert restore_query_blocks(messages, block, 1, 4) == 0
    assert len(messages) == 5


def test_a_block_with_detected_volatile_values_is_not_restated() -> None:
    """A date in the moved block would put today's date into earlier turns: not a restatement."""
    template = "Today is 2026-11-29 14:03.\n" + TEMPLATE
    last = conversation(CanonOptions(), template)[-1]
    assert [m["role"] for m in last].count("system") == 2
