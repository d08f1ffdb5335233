"""The open_webui scenario sends what the real app sends: turns, its background tasks in the
chat's session, and a tool set that grows mid-chat."""

from __future__ import annotations

from tests.test_workload import session_bodies


def test_background_tasks_share_the_chat_but_are_no_turn_of_it() -> None:
    bodies = session_bodies("open_webui", 1)
    tasks = [b for b in bodies if str(b["messages"][-1]["content"]).startswith("### Task:")]
    turns = [b for b in bodies if b not in tasks]
    questions = [b for b in turns if b["messages"][-1]["role"] == "user"]
    assert len(questions) >= 2 and len(tasks) == len(questions) + 2  # title and tags once, follow-ups per answer
    for task in tasks:
        system, user = task["messages"]
        assert system["role"] == "system" and "<chat_history>" in user["content"] and "tools" not in task
    # A turn's history holds only the chat: no task, no task answer.
    for turn in turns:
        assert not any(str(m.get("content")).startswith("### Task:") for m in turn["messages"])


def test_the_tool_set_grows_mid_chat() -> None:
    bodies = [b for b in session_bodies("open_webui", 1) if "tools" in b]
    counts = [len(b["tools"]) for b in bodies]
    assert counts[0] < counts[-1] and sorted(counts) == counts
    first = [t["function"]["name"] for t in bodies[0]["tools"]]
    assert [t["function"]["name"] for t in bodies[-1]["tools"]][: len(first)] == first
