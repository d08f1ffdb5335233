"""align: which forwarded message stands for which view message, the equal ends matched without hashing.

Checked against the plain diff of the whole lists (every message hashed), on the pipeline's edits:
lines moved out of a system prompt, a block inserted before the last user turn, old turns folded
into a summary, a rewritten tool call, and repeated messages.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.protocols import align as align_module
from proxy.protocols.align import Aligned, align


def whole_diff(view: list[Any], forwarded: list[Any]) -> list[Aligned]:
    return align_module._diff(view, forwarded)


def assert_aligns_as_the_whole_diff(view: list[Any], forwarded: list[Any]) -> None:
    """Each forwarded message stands for a view message of its role, in order, and is marked changed
    exactly when it differs from it; no fewer are found unchanged than the whole diff finds."""
    aligned = align(view, forwarded)
    assert len(aligned) == len(forwarded)
    for position, pair in enumerate(aligned):
        if pair.view is not None:
            assert view[pair.view]["role"] == forwarded[position]["role"]
            assert pair.changed == (view[pair.view] != forwarded[position])
    matched = [pair.view for pair in aligned if pair.view is not None]
    assert matched == sorted(set(matched))
    unchanged = sum(1 for pair in aligned if pair.view is not None and not pair.changed)
    assert unchanged >= sum(1 for pair in whole_diff(view, forwarded) if pair.view is not None and not pair.changed)


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse.\nToday is Monday."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}"})
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    messages.append({"role": "user", "content": "and now?"})
    return messages


def copies(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(m) for m in messages]  # as the engine copies them: new dicts, the same values


def test_an_unchanged_conversation_maps_one_to_one() -> None:
    view = conversation(5)
    assert align(view, copies(view)) == [Aligned(i, False) for i in range(len(view))]


def test_a_block_inserted_before_the_last_user_turn() -> None:
    view = conversation(4)
    forwarded = copies(view)
    forwarded[0] = {"role": "system", "content": "You are terse."}
    forwarded.insert(len(forwarded) - 1, {"role": "system", "content": "Today is Monday."})
    aligned = align(view, forwarded)
    assert aligned[0] == Aligned(0, True)
    assert aligned[-2] == Aligned(None, True)
    assert aligned[-1] == Aligned(len(view) - 1, False)
    assert aligned[1:-2] == [Aligned(i, False) for i in range(1, len(view) - 1)]
    assert aligned == whole_diff(view, forwarded)


def test_old_turns_folded_into_a_summary() -> None:
    view = conversation(6)
    forwarded = [copies(view)[0], {"role": "system", "content": "Summary: six questions."}, *copies(view)[9:]]
    aligned = align(view, forwarded)
    assert aligned == whole_diff(view, forwarded)
    assert aligned[0] == Aligned(0, False) and aligned[1].view is None
    assert aligned[2:] == [Aligned(i, False) for i in range(9, len(view))]


def test_a_rewritten_message_in_the_middle_is_paired_and_marked_changed() -> None:
    view = conversation(3)
    view[4] = {"role": "assistant", "content": None, "tool_calls": [{"id": "fresh", "function": {"name": "f"}}]}
    forwarded = copies(view)
    forwarded[4] = {"role": "assistant", "content": None, "tool_calls": [{"id": "kept", "function": {"name": "f"}}]}
    assert align(view, forwarded)[4] == Aligned(4, True)


@pytest.mark.parametrize("seed", range(400))
def test_the_ends_shortcut_agrees_with_the_whole_diff_on_edits_the_pipeline_makes(seed: int) -> None:
    rng = random.Random(seed)
    pool = [{"role": rng.choice(["user", "assistant"]), "content": rng.choice("abc")} for _ in range(12)]
    view = [rng.choice(pool) for _ in range(rng.randint(0, 10))]
    forwarded = copies(view)
    for _ in range(rng.randint(0, 3)):
        edit = rng.choice(["insert", "delete", "rewrite"])
        at = rng.randint(0, len(forwarded))
        if edit == "insert":
            forwarded.insert(at, {"role": "system", "content": rng.choice("xyz")})
        elif forwarded and at < len(forwarded):
            if edit == "delete":
                del forwarded[at]
            else:
                forwarded[at] = {**forwarded[at], "content": forwarded[at]["content"] + "!"}
    assert_aligns_as_the_whole_diff(view, forwarded)


@pytest.mark.parametrize("seed", range(200))
@pytest.mark.parametrize("same_objects", [True, False])
def test_long_conversations_align_as_the_whole_diff_does(seed: int, same_objects: bool) -> None:
    """Past ``ANCHOR_MIN`` messages the middle is aligned on anchors (the view's very objects, or
    serializations unique in both lists) with only the runs between them diffed: each forwarded
    message stands for a view message of its role, in order, and no fewer are found unchanged."""
    rng = random.Random(seed)
    view = conversation(rng.randint(8, 40))
    if rng.random() < 0.3:
        view[3:3] = [dict(view[1]), dict(view[2])]  # a repeated exchange: its serialization not unique
    forwarded = list(view) if same_objects else copies(view)
    forwarded[0] = {"role": "system", "content": "You are terse."}  # a line moved out of the system prompt
    for _ in range(rng.randint(0, 4)):
        edit = rng.choice(["insert", "fold", "rewrite"])
        at = rng.randint(1, len(forwarded) - 1)
        if edit == "insert":
            forwarded.insert(at, {"role": "system", "content": f"moved {at}"})
        elif edit == "fold":
            del forwarded[at : at + rng.randint(1, 6)]
        else:
            forwarded[at] = {**forwarded[at], "content": str(forwarded[at].get("content")) + "!"}
    assert_aligns_as_the_whole_diff(view, forwarded)


@pytest.mark.parametrize("same_objects", [True, False])
def test_a_long_history_between_a_changed_top_and_an_inserted_block_is_not_diffed(
    monkeypatch: pytest.MonkeyPatch, same_objects: bool
) -> None:
    """A system prompt whose clock moved out and a block before the last user turn: the 2,000
    messages between are anchors, and what is diffed is a few messages, not the conversation (a diff of
    it all made a 1,000-turn conversation on /v1/messages cost 30 ms a request)."""
    view = conversation(1000)
    forwarded = list(view) if same_objects else copies(view)
    forwarded[0] = {"role": "system", "content": "You are terse."}
    forwarded.insert(len(forwarded) - 1, {"role": "system", "content": "Today is Monday."})
    sizes: list[int] = []
    diff = align_module._diff

    def recorded(a: list[Any], b: list[Any]) -> list[Aligned]:
        sizes.append(len(a) + len(b))
        return diff(a, b)

    monkeypatch.setattr(align_module, "_diff", recorded)
    aligned = align(view, forwarded)
    assert max(sizes) <= 4, max(sizes)
    assert aligned[0] == Aligned(0, True) and aligned[-2] == Aligned(None, True)
    assert aligned[1:-2] == [Aligned(i, False) for i in range(1, len(view) - 1)]
