"""Restorations (a conversation's moved lines go back where they went before, when all are in its
system prompt again) look only at the blocks that can have become held: those held last time, new
ones, and those with a line new in the system prompt. The same decisions as looking at every block
of the conversation, at a cost that does not grow with it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.relocation import _Layout
from proxy.config import CanonSettings

STABLE = "\n".join(f"Rule {n}: answer in the way number {n} says, and keep it brief." for n in range(40))
DAYS = ("Monday", "Tuesday", "Wednesday")
STATES = ("online", "offline")


def _conversation(seed: int, turns: int, clock: bool, every: int = 1) -> list[dict[str, Any]]:
    """Requests of one conversation whose system prompt opens with values that come back (a day,
    a status: drawn again every ``every`` turns) and, with ``clock``, a time that never does."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = []
    requests = []
    day, state = rng.choice(DAYS), rng.choice(STATES)
    for turn in range(turns):
        if turn % every == 0:
            day, state = rng.choice(DAYS), rng.choice(STATES)
        lines = [f"Today is {day}.", f"Service status: {state}"]
        if clock:
            lines.insert(0, f"Current time: 2026-12-05T10:{turn // 60:02d}:{turn % 60:02d}Z")
        system = "\n".join(lines) + "\n" + STABLE
        history.append({"role": "user", "content": f"Question {turn}: what about item {rng.randint(0, 9999)}?"})
        requests.append({"model": "m", "messages": [{"role": "system", "content": system}, *history]})
        history = [*history, {"role": "assistant", "content": f"Answer {turn}."}]
    return requests


def _forwarded(requests: list[dict[str, Any]], every_block: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    with monkeypatch.context() as patched:
        if every_block:
            patched.setattr(_Layout, "_maybe_held", lambda self, m, s, offsets, t: (offsets, False))
        canonicalizer = Canonicalizer(CanonSettings())
        return [json.dumps(canonicalizer.apply(r, "tenant").body) for r in requests]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("clock", [False, True])
def test_the_same_layout_as_looking_at_every_block(seed: int, clock: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = _conversation(seed, 40, clock)
    assert _forwarded(requests, False, monkeypatch) == _forwarded(requests, True, monkeypatch)


def test_blocks_looked_at_do_not_grow_with_the_conversation(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_at: list[int] = []
    original = ForwardedLayouts.blocks_at

    def counting(self: ForwardedLayouts, position: int) -> Any:
        looked_at.append(position)
        return original(self, position)

    monkeypatch.setattr(ForwardedLayouts, "blocks_at", counting)
    canonicalizer = Canonicalizer(CanonSettings())
    per_request = []
    # The clock ticks every turn, the day and the status change now and then (every 25 turns).
    for request in _conversation(7, 240, clock=True, every=25):
        looked_at.clear()
        canonicalizer.apply(request, "tenant")
        per_request.append(len(looked_at))
    # A block is inserted on every turn (the clock moves): looking at each would be one more per turn.
    # A day or status coming back makes the blocks that held it candidates again (on that request).
    changed = {turn for turn in range(240) if turn % 25 == 0}
    steady = [count for turn, count in enumerate(per_request) if turn >= 20 and turn not in changed]
    assert max(steady) <= 8, steady[-10:]
