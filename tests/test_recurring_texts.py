"""A tenant's long non-ASCII texts sent again arrive as the strings made the first time
(proxy.openai.recurring): equal, so nothing forwarded changes; the same object, so their UTF-8 form
is not made again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from bench import shapes
from proxy.http.body import parse_json_object
from proxy.openai import recurring

PROMPT = "你是一个旅行规划大师，请根据下面的信息，安排用户的行程。\n" * 60  # about 2k characters


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    recurring.forget()
    yield
    recurring.forget()


def parsed(body: dict[str, Any], tenant: str | None = "t") -> dict[str, Any]:
    return parse_json_object(json.dumps(body).encode(), tenant)


def test_a_prompt_sent_again_is_the_string_made_the_first_time() -> None:
    shape = shapes.build("dify-same", 3000)
    first = parsed(shape.body(0))["messages"][0]["content"]
    again = parsed(shape.body(1))
    assert again["messages"][0]["content"] is first
    # What is forwarded is the same, byte for byte.
    assert orjson.dumps(again) == orjson.dumps(json.loads(json.dumps(shape.body(1))))


def test_one_tenant_never_gets_another_tenants_string() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": PROMPT}]}
    first = parsed(body, "a")["messages"][0]["content"]
    other = parsed(body, "b")["messages"][0]["content"]
    assert other == first and other is not first
    assert parsed(body, "a")["messages"][0]["content"] is first
    assert parsed(body, None)["messages"][0]["content"] is not first  # no tenant, nothing reused


def test_a_text_with_the_same_length_and_ends_but_another_middle_is_its_own() -> None:
    lines = PROMPT.splitlines(keepends=True)
    changed = "".join([*lines[:30], lines[30].replace("旅行", "行程"), *lines[31:]])
    assert len(changed) == len(PROMPT) and changed[:60] == PROMPT[:60] and changed[-60:] == PROMPT[-60:]
    first = parsed({"model": "m", "messages": [{"role": "system", "content": PROMPT}]})["messages"][0]["content"]
    second = parsed({"model": "m", "messages": [{"role": "system", "content": changed}]})["messages"][0]["content"]
    assert second == changed and second is not first
    # The text last seen is the one kept.
    third = parsed({"model": "m", "messages": [{"role": "system", "content": changed}]})["messages"][0]["content"]
    assert third is second


def test_only_long_non_ascii_texts_are_kept() -> None:
    short = "你好，" * 10
    english = "You are a helpful assistant. " * 100
    body = {"model": "m", "messages": [{"role": "system", "content": short}, {"role": "user", "content": english}]}
    first = parsed(body)["messages"]
    again = parsed(body)["messages"]
    assert again[0]["content"] is not first[0]["content"]
    assert again[1]["content"] is not first[1]["content"]


def test_every_protocols_text_places() -> None:
    anthropic = {
        "model": "m",
        "system": [{"type": "text", "text": PROMPT}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT + "？"}]}],
    }
    responses = {"model": "m", "instructions": PROMPT + "。", "input": [{"role": "user", "content": PROMPT + "！"}]}
    chat_parts = {"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": PROMPT + "…"}]}]}

    def texts(body: dict[str, Any]) -> list[str]:
        found = [body.get("instructions")] if "instructions" in body else []
        found += [part["text"] for part in body.get("system", [])]
        for item in body.get("messages", body.get("input", [])):
            content = item["content"]
            found += [content] if isinstance(content, str) else [part["text"] for part in content]
        return found

    for body in (anthropic, responses, chat_parts):
        first, again = texts(parsed(body)), texts(parsed(body))
        assert again == first and all(a is b for a, b in zip(again, first, strict=True))


def test_the_kept_texts_are_bounded_by_characters() -> None:
    huge = "漢" * (recurring.MAX_CHARS + 1)
    assert recurring.same_text(huge, "t") is huge
    assert recurring.same_text(huge[:1] + huge[1:], "t") is not huge  # an equal copy: never kept
    texts = [f"{n}" + "漢字" * (recurring.MAX_CHARS // 6) for n in range(5)]
    for text in texts:
        recurring.same_text(text, "t")
    assert recurring._kept.currsize <= recurring.MAX_CHARS
    assert 0 < sum(recurring.same_text(text[:1] + text[1:], "t") is text for text in reversed(texts)) < 5


def test_a_conversation_looks_into_the_history_it_sent_before_only_where_its_long_texts_are() -> None:
    """The history a conversation sent before is not walked again: its long non-ASCII texts (found
    then) are the strings kept, the rest is left as parsed, and what it adds is looked at."""
    reply = "好的，我们先看第一天的安排：上午参观博物馆，下午去老城区。\n" * 40
    history: list[dict[str, Any]] = [{"role": "system", "content": PROMPT}]
    for turn in range(6):
        history.append({"role": "user", "content": f"第{turn}天怎么安排？"})
        history.append({"role": "assistant", "content": reply + str(turn)})
    body = {"model": "m", "messages": [*history, {"role": "user", "content": "那第七天呢？"}]}
    first = parsed(body)["messages"]
    looked: list[int] = []
    original = recurring._reuse_in

    def counting(container: dict[str, Any], key: str, namespace: str) -> bool:
        looked.append(id(container))
        return original(container, key, namespace)

    recurring._reuse_in = counting  # type: ignore[assignment]
    try:
        grown = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": "好。"},
                {"role": "user", "content": "谢谢"},
            ],
        }
        again = parsed(grown)["messages"]
    finally:
        recurring._reuse_in = original  # type: ignore[assignment]
    # The body's own texts (system, instructions), the system prompt, the six long replies and the
    # two new messages: not the six short questions.
    assert len(looked) == 2 + 1 + 6 + 2
    for index in range(2, 13, 2):
        assert again[index]["content"] is first[index]["content"]
    assert orjson.dumps(again) == orjson.dumps(json.loads(json.dumps(grown))["messages"])
