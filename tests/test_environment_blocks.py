"""Agents' environment blocks: recognized from what they are, moved behind the tools from a
conversation's first request, the same way on every turn of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.canon.canonicalizer import Canonicalizer
from proxy.canon.volatile import detect_environment_blocks
from proxy.config import CanonSettings
from testbed.demo import run_demo
from testbed.workload.corpus import dify_nodes
from tests.helpers import LiveServer

CLAUDE_CODE = """You are Claude Code, Anthropic's official CLI for Claude.
You are an interactive CLI tool that helps users with software engineering tasks.

# Tone and style
- Be concise, direct, and to the point.
- Platform conventions: follow the repository's style.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/dev/src/billing
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.1.0-27-amd64
Today's date: 2026-12-01
</env>
You are powered by the model named tiny-llama.

IMPORTANT: Always use the TodoWrite tool to plan and track tasks.

gitStatus: This is the git status at the start of the conversation. Note that this status is a snapshot in time, \
and will not update during the conversation.
Current branch: main

Main branch (you will usually use this for PRs): main

Status:
 M src/app.py
?? notes.txt

Recent commits:
{commits}"""

OPENCODE = """You are opencode, an interactive CLI agent.

Here is some useful information about the environment you are running in:
<env>
  Working directory: /home/u/proj
  Is directory a git repo: yes
  Platform: linux
  Today's date: Tue Dec 01 2026
</env>
<files>
  src/
  src/app.py
  README.md
  pyproject.toml
</files>

Be brief and answer in the user's language."""

COMMITS = ["a1b2c3d Add retry budget", "9f8e7d6 Fix the parser's off-by-one", "4c5d6e7 Initial import"]


def spans(text: str) -> list[str]:
    return [text[s.start : s.end] for s in detect_environment_blocks(text)]


def test_claude_code_environment_and_git_status_are_whole_blocks() -> None:
    text = CLAUDE_CODE.format(commits="\n".join(COMMITS))
    env, git = spans(text)
    assert env.startswith("Here is useful information about the environment") and env.endswith("</env>")
    assert git.startswith("gitStatus:") and git.endswith(COMMITS[-1])
    assert "Recent commits:" in git and "Status:\n M src/app.py\n?? notes.txt" in git
    # The instructions around them are no environment.
    assert "Platform conventions" not in env + git and "TodoWrite" not in env + git


def test_a_commit_whose_short_hash_is_all_digits_is_a_commit_line() -> None:
    """About 4% of 7-character abbreviations hold no letter a-f: "5949420 Initial commit" left the
    "Recent commits:" list in the system prompt on the real Claude Code's first turn, and the next
    turn, moving it, recomputed everything after it."""
    for commits in (["5949420 Initial commit"], ["0341666 Review round 1", "c983482 Initial commit"]):
        text = CLAUDE_CODE.format(commits="\n".join(commits))
        _, git = spans(text)
        assert git.endswith(commits[-1])
    # Numbered lines read alike: without facts around them, they are no environment.
    assert not spans("Limits:\n12345678901234 requests a day\n98765432101234 tokens a minute")
    assert not spans("Holiday calendar:\n20240101 New Year's Day\n20241225 Christmas Day")
    assert not spans("Phones:\n5551234 Front desk\n5551235 Back office\n- 1048576 Login fails")
    assert not spans("<phones>\n5551234 Front desk\n5551235 Back office\n5551236 Kitchen\n</phones>")


def test_a_file_listing_in_a_tag_block_goes_with_the_environment() -> None:
    (block,) = spans(OPENCODE)
    assert block.startswith("Here is some useful information") and block.endswith("</files>")


# The team's copy of the real Dify prompts (84 system prompts) where the checkout has it beside it;
# else the 11 the package bundles.
SHARED_DIFY = Path(__file__).resolve().parents[2] / "shared" / "data" / "dify_prompts.jsonl"


def dify_system_prompts() -> list[str]:
    if not SHARED_DIFY.exists():
        return [node.system for node in dify_nodes().values() if node.system]
    records = [json.loads(line) for line in SHARED_DIFY.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [m["text"] for r in records for m in r["messages"] if m["role"] == "system" and m["text"]]


def test_instructions_are_not_environment() -> None:
    prompts = dify_system_prompts()
    assert len(prompts) >= 11
    found = {prompt[:60]: spans(prompt) for prompt in prompts}
    assert not {k: v for k, v in found.items() if v}
    rules = "Rules:\n- Time: answer within a minute.\n- Date formats: ISO 8601.\nPlatform: web and mobile."
    assert spans(rules) == []


def test_a_list_of_install_paths_is_not_environment() -> None:
    """pi's system prompt lists its documentation's install paths (``- Main documentation: /...``)
    right above its date and working directory: two path-valued items made a run of facts, moved at
    first sight out of their labelled list (a helper's trial). A run must name something about the
    environment; paths beside such facts still go with them."""
    prompt = (
        "Pi documentation (read only when the user asks about pi itself):\n"
        "- Main documentation: /usr/lib/node_modules/pi/README.md\n"
        "- Additional docs: /usr/lib/node_modules/pi/docs\n"
        "- Examples: /usr/lib/node_modules/pi/examples (extensions, custom tools)\n"
        "Current date: 2026-12-05\n"
        "Current working directory: /tmp/repo"
    )
    assert spans(prompt) == ["Current date: 2026-12-05\nCurrent working directory: /tmp/repo"]
    assert spans("Links:\n- Docs: /usr/share/doc/x\n- Man page: /usr/share/man/x.1") == []
    beside = "Working directory: /tmp/repo\nProject root: /tmp/repo/app"
    assert spans(beside) == [beside]


def chat(system: str, turns: list[str], replies: list[str]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for number, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if number < len(replies):
            messages.append({"role": "assistant", "content": replies[number]})
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("Bash", "Read")]
    return {"model": "m", "messages": messages, "tools": tools}


def texts(body: dict[str, Any]) -> list[str]:
    return [json.dumps(m, sort_keys=True) for m in body["messages"]]


def test_moved_at_the_first_request_and_kept_in_place_while_unchanged() -> None:
    canonicalizer = Canonicalizer(CanonSettings())
    system = CLAUDE_CODE.format(commits="\n".join(COMMITS))
    first = canonicalizer.apply(chat(system, ["Fix the retry logic."], []), "t")
    assert any(a.kind == "volatile_environment" for a in first.actions)
    stable = first.body["messages"][0]["content"]
    assert "<env>" not in stable and "Recent commits:" not in stable and "TodoWrite" in stable
    second = canonicalizer.apply(chat(system, ["Fix the retry logic.", "Now run the tests."], ["Done."]), "t")
    # The second turn extends what the first forwarded: the block stays before the first question.
    assert texts(second.body)[: len(first.body["messages"])] == texts(first.body)


def test_a_status_label_whose_value_became_status_lines_is_the_same_place() -> None:
    """agno: ``Git status:`` then ``clean`` (not detected), then status lines (detected) after an
    edit. The places around it were keyed on the detected lines alone, so the edit made the clock's
    place look new and the clock moved a request later than without the edit (a helper's trial)."""

    def system(clock: str, status: str) -> str:
        return (
            "You are a coding agent. Use the tools to read and edit files.\n\n"
            f"<additional_information>\n- The current time is {clock}.\n</additional_information>\n\n"
            f"Working directory: /tmp/repo\nGit status:\n{status}"
        )

    def clock_moves(statuses: list[str]) -> list[bool]:
        canonicalizer = Canonicalizer(CanonSettings())
        moved = []
        for number, status in enumerate(statuses):
            clock = f"2026-12-05 16:1{number}:21.012004"
            body = chat(system(clock, status), [f"Task {number}: fix calc.py"], [])
            result = canonicalizer.apply(body, "t")
            moved.append(clock not in result.body["messages"][0]["content"])
        return moved

    plain = clock_moves(["clean", "clean", "clean", "clean"])
    edited = clock_moves(["clean", " M calc.py\n?? test_calc.py", " M calc.py", " M calc.py"])
    assert plain == edited, (plain, edited)
    assert plain[-1]


def test_a_new_history_begins_with_the_block_its_app_began_with() -> None:
    """After a compaction (the client's own: its history replaced by a summary) the unchanged
    block goes at the conversation's start again, where it is cached, not before the last turn."""
    canonicalizer = Canonicalizer(CanonSettings())
    system = CLAUDE_CODE.format(commits="\n".join(COMMITS))
    first = canonicalizer.apply(chat(system, ["Fix the retry logic."], []), "t")
    canonicalizer.apply(chat(system, ["Fix the retry logic.", "Now run the tests."], ["Done."]), "t")
    block = first.body["messages"][1]
    assert block["role"] == "system" and "<env>" in block["content"]
    summary = "This session is being continued from a previous conversation. Summary: retries fixed."
    compacted = canonicalizer.apply(chat(system, [summary, "Anything else?"], ["Nothing more."]), "t")
    assert compacted.body["messages"][:2] == first.body["messages"][:2]
    assert any(a.kind == "volatile_moved" and a.detail == "conversation_start" for a in compacted.actions)
    # The block changed (a commit): nothing to keep cached, it goes to the default place.
    changed = CLAUDE_CODE.format(commits="\n".join(["0a0b0c0 Bump", *COMMITS]))
    moved = canonicalizer.apply(chat(changed, ["Another summary.", "And now?"], ["Yes."]), "t")
    assert moved.body["messages"][1]["role"] == "user"


def test_a_commit_between_turns_costs_only_the_block(fake_backend: LiveServer) -> None:
    result = run_demo(sessions=3, scenarios="coding_agent,coding_agent_commits", progress=False)
    assert result.errors == 0
    direct, proxied = result.direct["coding_agent_commits"], result.proxied["coding_agent_commits"]
    assert proxied.requests == direct.requests > 0
    assert proxied.prefill_tokens <= 0.6 * direct.prefill_tokens, (proxied.prefill_tokens, direct.prefill_tokens)
    unchanged = result.proxied["coding_agent"].prefill_tokens
    assert unchanged <= result.direct["coding_agent"].prefill_tokens
