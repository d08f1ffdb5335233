"""Move only what varies, and put a moved block where the conversation's backend saw it.

Each test plays requests through one proxy's canonicalizer (its default settings) and checks the
forwarded layout turn by turn: what stays, what moves, and that each turn extends what the
previous turn was forwarded with wherever the client's own text allows it.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.varying import VaryingPlaces
from proxy.config import CanonSettings

INSTRUCTIONS = "You are a support assistant.\nAnswer briefly and politely.\nNever invent order numbers."


def system(value: str) -> str:
    return f"Current time: {value}\n{INSTRUCTIONS}"


def request(system_prompt: str, *history: str) -> dict[str, Any]:
    """``history``: user, assistant, user, ... (ends with a user message)."""
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": system_prompt}]
    messages += [{"role": roles[i % 2], "content": text} for i, text in enumerate(history)]
    return {"model": "m", "messages": messages}


def forwarded(canonicalizer: Canonicalizer, body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = canonicalizer.apply(body, "tenant").body["messages"]
    return messages


def extends(longer: list[dict[str, Any]], shorter: list[dict[str, Any]]) -> bool:
    return json.dumps(longer[: len(shorter)]) == json.dumps(shorter)


def test_a_span_that_never_varies_stays_where_the_client_put_it() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    for turn in range(5):
        history = [f"q{i}" if i % 2 == 0 else f"a{i}" for i in range(2 * turn + 1)]
        body = request(system("2026-11-30 09:00:00"), *history)
        assert forwarded(canonicalizer, body) == body["messages"]


def test_a_span_moves_once_its_place_has_varied_and_keeps_moving() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    first = forwarded(canonicalizer, request(system("09:00:00"), "hello"))
    assert first[0]["content"] == system("09:00:00"), "first sight: nothing is known to vary"
    second = forwarded(canonicalizer, request(system("09:00:05"), "hi there"))
    assert second[0]["content"] == INSTRUCTIONS
    assert second[1] == {"role": "system", "content": "Current time: 09:00:05"}
    # The same value again later: the place has varied, so it keeps moving (no flip back).
    again = forwarded(canonicalizer, request(system("09:00:05"), "something else"))
    assert again[0]["content"] == INSTRUCTIONS


def test_a_conversation_forwarded_in_place_keeps_its_layout() -> None:
    """Conversation A started while the span had not varied; another conversation then made it vary.
    A's next turns keep the span in place: moving it now would cost A its whole history."""
    canonicalizer = Canonicalizer(CanonSettings())
    a1 = forwarded(canonicalizer, request(system("2026-11-30"), "A: first question"))
    forwarded(canonicalizer, request(system("2026-12-01"), "B: first question"))  # the place varies now
    a2 = forwarded(canonicalizer, request(system("2026-11-30"), "A: first question", "answer", "A: next"))
    assert extends(a2, a1)
    assert a2[0]["content"] == system("2026-11-30")


def test_an_unchanged_block_goes_back_where_the_conversation_saw_it() -> None:
    """A block that varies between conversations but not within one (a user's name, a date) is
    inserted before the conversation's first question, and stays there: every turn extends the last."""
    canonicalizer = Canonicalizer(CanonSettings())
    forwarded(canonicalizer, request(system("2026-11-29"), "warm-up"))
    forwarded(canonicalizer, request(system("2026-11-28"), "warm-up 2"))  # varied: moves from now on
    history: list[str] = []
    previous: list[dict[str, Any]] = []
    for turn in range(4):
        history += [f"question {turn}"]
        messages = forwarded(canonicalizer, request(system("2026-11-30"), *history))
        assert messages[0]["content"] == INSTRUCTIONS
        assert messages[1] == {"role": "system", "content": "Current time: 2026-11-30"}
        assert extends(messages, previous), f"turn {turn} must extend turn {turn - 1}"
        previous = messages
        history += [f"answer {turn}"]


def test_a_block_that_changes_every_turn_goes_before_the_last_question() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    forwarded(canonicalizer, request(system("08:00:00"), "warm-up"))
    history: list[str] = []
    for turn in range(3):
        history += [f"question {turn}"]
        messages = forwarded(canonicalizer, request(system(f"09:00:0{turn}"), *history))
        assert messages[-2] == {"role": "system", "content": f"Current time: 09:00:0{turn}"}
        assert messages[-1] == {"role": "user", "content": f"question {turn}"}
        history += [f"answer {turn}"]


def test_an_empty_context_wrapper_stays_put() -> None:
    """Dify's context prompt around nothing (no chunk retrieved) is the same on every request."""
    canonicalizer = Canonicalizer(CanonSettings())
    prompt = "Use the following context.\n<context>\n\n</context>\n\nAnswer briefly."
    history: list[str] = []
    for turn in range(4):
        history += [f"question {turn}"]
        body = request(prompt, *history)
        assert forwarded(canonicalizer, body) == body["messages"]
        history += [f"answer {turn}"]


def test_moving_at_first_sight_can_be_configured() -> None:
    canonicalizer = Canonicalizer(CanonSettings(move_only_varying=False))
    messages = forwarded(canonicalizer, request(system("09:00:00"), "hello"))
    assert messages[0]["content"] == INSTRUCTIONS


def test_places_are_per_app_and_bounded() -> None:
    places = VaryingPlaces(max_apps=2)
    where = (0, 0, "datetime", 0)
    assert not places.observe("app-a", where, "1")
    assert places.observe("app-a", where, "2")
    assert not places.observe("app-b", where, "1"), "another app's variation says nothing about this one"
    places.observe("app-c", where, "1")
    assert len(places) == 2
    assert not places.observe("app-a", where, "3"), "forgotten (least recently used): first sight again"
