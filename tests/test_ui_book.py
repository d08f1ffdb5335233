"""The operator page's memory (proxy.observability.apps) and the floor (proxy.observability.floor): pure."""

from __future__ import annotations

from typing import Any

from proxy.observability.apps import AppBook
from proxy.observability.breaks import CacheBreak
from proxy.observability.floor import FloorMeter, SeenSet


def test_floor_counts_lines_no_earlier_request_carried() -> None:
    meter = FloorMeter(1000)
    first = [{"role": "system", "content": "alpha beta\n\ngamma"}, {"role": "user", "content": "one two three"}]
    floor = meter.measure(first)
    # Bytes of each new line and its newline; the request's own: every line.
    assert (floor.new_lines, floor.new_bytes) == (3, 11 + 6 + 14)
    assert floor.total_bytes == floor.new_bytes + 1  # the blank line
    # Tokens at the rate the backend reported for the request: 64 prompt tokens over its 32 bytes.
    assert floor.tokens(64) == 62 and floor.tokens(0) == round(31 * 0.25)
    # The same system prompt, the model's reply (seen: it generated it) and a new question.
    second = [
        *first,
        {"role": "assistant", "content": "a reply of five words"},
        {"role": "user", "content": "four five\nalpha beta"},
    ]
    floor = meter.measure(second)
    assert (floor.new_lines, floor.new_bytes) == (1, len("four five\n"))  # "alpha beta" was carried before
    assert meter.measure(second).tokens(100) == 0


def test_floor_counts_a_tool_once_and_a_reply_as_seen() -> None:
    meter = FloorMeter(1000)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}
    assert meter.measure([{"role": "user", "content": "x"}], [tool]).new_lines == 2
    reordered = {"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}
    assert meter.measure([{"role": "user", "content": "x"}], [reordered]).new_lines == 0
    meter.saw_reply({"role": "assistant", "content": "the answer is here"})
    # A client that re-sends the reply as a user quote: the backend generated those tokens.
    assert meter.measure([{"role": "user", "content": "the answer is here"}]).new_bytes == 0


def test_seen_set_is_bounded_and_keeps_what_is_used_again() -> None:
    seen = SeenSet(10)
    for item in range(1000):
        seen.add(item)
        seen.add(0)  # used all along
    assert len(seen) <= 10
    assert 0 in seen and 999 in seen and 500 not in seen


def chat(system: str, user: str = "hi", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages} | extra


STABLE = "\n".join(f"rule {i}: be helpful in way {i}" for i in range(10))


def test_apps_are_told_apart_by_template_and_lines_that_vary_are_marked() -> None:
    book = AppBook(keep_text=True)
    for minute in range(3):
        system = f"Current time: 10:0{minute}\n{STABLE}"
        book.record(
            tenant="t", model="m", client=chat(system), forwarded=chat(system), stable_count=1, prompt_tokens=100
        )
    other = "\n".join(f"you translate text {i}" for i in range(10))
    book.record(tenant="t", model="m", client=chat(other), forwarded=chat(other), stable_count=1, prompt_tokens=50)
    book.record(tenant="u", model="m", client=chat(other), forwarded=chat(other), stable_count=1, prompt_tokens=50)
    apps = book.apps()
    assert [(a.tenant, a.requests) for a in apps] == [("t", 3), ("t", 1), ("u", 1)]
    picture = apps[0].prompt
    assert picture is not None and picture.varies == {0} and not picture.moved
    assert [(u.first, u.last, u.kind) for u in picture.units] == [(0, 0, "key: value")]
    assert picture.text is not None and picture.text.startswith("Current time: 10:02")
    assert apps[0].title == "rule 0: be helpful in way 0"


def test_moved_units_are_the_lines_absent_from_the_forwarded_system_prompt() -> None:
    book = AppBook(keep_text=False)
    for day in range(2):
        block = f"<context>\nretrieved chunk {day}\nand another {day}\n</context>"
        system = f"{block}\n{STABLE}"
        forwarded = {
            "model": "m",
            "messages": [
                {"role": "system", "content": STABLE},
                {"role": "system", "content": block},
                {"role": "user", "content": "hi"},
            ],
        }
        app = book.record(
            tenant="t",
            model="m",
            client=chat(system),
            forwarded=forwarded,
            stable_count=1,
            actions=["volatile_context_block:1", "volatile_moved:before_last_user"],
            prompt_tokens=200,
            cached_tokens=150,
        )
    picture = app.prompt
    assert picture is not None
    assert picture.moved == {0, 1, 2, 3} and picture.varies == {1, 2}
    (unit,) = picture.units
    assert (unit.first, unit.last, unit.kind, unit.varies, unit.moved) == (0, 3, "tagged block", True, True)
    # No prompt text kept: no text, no tag name, no title.
    assert picture.text is None and unit.label is None and app.title is None
    assert app.actions == {"volatile_context_block": 2, "volatile_moved": 2}
    assert (app.prompt_tokens, app.cached_tokens, app.prefill_tokens) == (400, 300, 100)
    # The second request's floor: its new context lines only, at its own tokens per byte.
    new_bytes = len("retrieved chunk 1\nand another 1\n")
    total_bytes = len(forwarded["messages"][0]["content"]) + len(block) + 2 + len("hi") + 1
    assert app.last[2] == round(new_bytes * 200 / total_bytes)


def test_lines_moved_to_the_end_of_the_system_message_are_found() -> None:
    """relocate_target: system_end keeps one system message: the moved lines sit at its end."""
    book = AppBook()
    system = f"Today is 2026-05-01\n{STABLE}"
    forwarded = chat(f"{STABLE}\nToday is 2026-05-01")
    app = book.record(
        tenant="t",
        model="m",
        client=chat(system),
        forwarded=forwarded,
        stable_count=1,
        actions=["volatile_moved:system_end"],
    )
    assert app.prompt is not None and app.prompt.moved == {0}


def test_breaks_name_the_line_and_keep_text_only_when_allowed() -> None:
    for keep in (True, False):
        book = AppBook(keep_text=keep)
        book.record(tenant="t", model="m", client=chat(STABLE), forwarded=chat(STABLE), stable_count=1)
        changed = STABLE.replace("rule 3: be helpful in way 3", "rule 3: <b>changed</b>")
        explanation = CacheBreak("system_changed", 0, 4)
        explanation.tokens_lost = 42
        book.record(
            tenant="t",
            model="m",
            client=chat(changed),
            forwarded=chat(changed),
            stable_count=1,
            session="s1",
            explanation=explanation,
        )
        (record,) = book.breaks()
        assert (record.cause, record.message, record.line, record.tokens_lost, record.role) == (
            "system_changed",
            0,
            4,
            42,
            "system",
        )
        assert record.now_digest and record.before_digest and record.now_digest != record.before_digest
        if keep:
            assert (record.before_text, record.now_text) == ("rule 3: be helpful in way 3", "rule 3: <b>changed</b>")
        else:
            assert record.before_text is None and record.now_text is None


def test_memory_is_bounded() -> None:
    book = AppBook(max_apps=4, breaks=3, floor_lines=64)
    for index in range(20):
        system = "\n".join(f"app {index} line {i}" for i in range(5))
        explanation = CacheBreak("new_conversation", 0)
        book.record(
            tenant="t", model=f"m{index}", client=chat(system), forwarded=chat(system), stable_count=1,
            explanation=explanation,
        )  # fmt: skip
    assert len(book) == 4
    assert len(book.breaks()) == 3
    assert {a.model for a in book.apps()} == {"m16", "m17", "m18", "m19"}
