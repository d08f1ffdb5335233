"""Moved text moves whole: a document, a code block or a list leaves the system prompt in one piece.

Learned volatility aligns each prompt against the template's earlier ones (in order, on line
hashes), and a varying region extends over lines too weak to anchor it (fences, rules, blank or
repeated lines) and to the block holding it (fenced code, a tagged block, an introduced list).
"""

from __future__ import annotations

import random
import re
from typing import Any

from proxy.canon import CanonOptions, LearnedVolatility, canonicalize
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.units import units_of
from proxy.canon.varying import VaryingPlaces
from proxy.canon.volatile import BUILTIN_DETECTORS, Span, regex_detector
from testbed.workload.scenarios.dify_workflow import DifyWorkflowSession

RELOCATE = CanonOptions()


class Memories:
    def __init__(self) -> None:
        self.learned = LearnedVolatility()
        self.varying = VaryingPlaces()
        self.layouts = ForwardedLayouts()

    def apply(self, body: dict[str, Any], options: CanonOptions = RELOCATE) -> Any:
        return canonicalize(
            body,
            options,
            namespace="t",
            learned=self.learned,
            varying=self.varying,
            layouts=self.layouts,
        )


def request(system: str, *turns: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for number, turn in enumerate(turns):
        if number:
            messages.append({"role": "assistant", "content": f"answer {number}"})
        messages.append({"role": "user", "content": turn})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return body


def moved_text(body: dict[str, Any]) -> str:
    """The inserted block (a blank line that separated it from the text on both sides goes along)."""
    return "\n".join(m["content"] for m in body["messages"][1:] if m["role"] == "system")


def moved_block(body: dict[str, Any]) -> str:
    return moved_text(body).strip("\n")


def stable_text(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"])


def partition_is_byte_identical(sent: str, body: dict[str, Any]) -> bool:
    """Every line of the client's system prompt arrives once, on one side, byte for byte."""
    moved = moved_text(body)
    if not moved:
        return stable_text(body) == sent
    return sorted(stable_text(body).split("\n") + moved.split("\n")) == sorted(sent.split("\n"))


TOP = [
    "You are the release assistant of the payments team.",
    "- Answer in short paragraphs.",
    "Cite the file you rely on.",
    "---",
    "Never invent an API that the code does not show.",
]
# Both blocks begin and end with a line of their own (a strong anchor); inside, lines recur.
BOTTOM = [
    "When the code does not answer the question, say so.",
    "---",
    "- Answer in short paragraphs.",
    "Prefer the smallest change that fixes the problem.",
]


def _block(rng: random.Random, kind: str, n: int) -> list[str]:
    """A block whose interior repeats lines found elsewhere (fences, ---, "- item", instructions)."""
    body = [f"value_{n}_{k} = compute({rng.randrange(10**6)})" for k in range(rng.randint(2, 5))]
    shared = rng.choice(["---", "- Answer in short paragraphs.", "```", "", "Cite the file you rely on."])
    body.insert(rng.randrange(1, len(body)), shared if shared != "```" or kind != "fence" else "---")  # interior
    if kind == "fence":
        return ["```python", *body, "```"]
    if kind == "tag":
        return [f'<document id="{rng.randrange(100)}">', *body, "</document>"]
    if kind == "list":
        return [f"- item {n} {line}" if line and line != shared else line for line in body]
    return body  # a paragraph region


def test_varying_blocks_with_shared_interior_lines_move_whole() -> None:
    """Property, over seeded random prompts: the block moves as one byte-identical run, the stable
    instruction blocks around it never move, and every line arrives exactly once."""
    for case in range(150):
        rng = random.Random(case)
        kind = rng.choice(["fence", "tag", "list", "paragraph"])
        memories = Memories()
        intro = rng.choice([[], ["Here is the retrieved context:"]])
        for n in range(5):
            block = _block(rng, kind, n)
            lines = [*TOP, "", *intro, *block, "", *BOTTOM]
            system = "\n".join(lines)
            result = memories.apply(request(system, f"question {n}"))
            out = result.body
            assert partition_is_byte_identical(system, out), case
            if n < 2:
                continue  # the first requests show the place varying
            moved, stable = moved_text(out), stable_text(out)
            run = "\n".join([*intro, *block]).strip("\n")
            assert run in moved, (case, kind, moved)
            for line in TOP + BOTTOM:
                assert line in stable.split("\n"), (case, line)
                assert line not in moved.split("\n") or line in block, (case, line)
            others = set(TOP + BOTTOM)
            for line in block:
                if line.strip() and line not in others:
                    assert line not in stable.split("\n"), (case, line)


def test_fences_stay_with_their_code_between_instruction_blocks() -> None:
    """The issue's case: retrieved code between two instruction blocks, fences also used elsewhere."""
    memories = Memories()
    top = "You review code.\n```\nuse this fence style\n```\nKeep answers short."
    bottom = "Answer the user's question about the code.\nDo not repeat the code back."
    for n in range(4):
        code = f"```python\ndef f{n}(x):\n    return x * {n}\n```"
        out = memories.apply(request(f"{top}\n\n{code}\n\n{bottom}", f"what does f{n} do?")).body
    assert stable_text(out) == f"{top}\n\n{bottom}"
    assert moved_block(out) == code


def test_a_list_with_one_new_item_moves_whole_with_its_introducer() -> None:
    memories = Memories()
    commits = ["a1b2 fix the retry loop", "c3d4 add the export script", "e5f6 bump the version"]
    head = "You are a coding agent working in this repository.\nFollow the style of the code."
    tail = "Use the tools to read files before editing them."
    for n in range(4):
        commits.insert(0, f"9{n}ab commit number {n}")
        listing = "Recent commits:\n" + "\n".join(commits[:4])
        out = memories.apply(request(f"{head}\n\n{listing}\n\n{tail}", "continue")).body
    assert stable_text(out) == f"{head}\n\n{tail}"
    assert moved_block(out) == listing


def test_a_detected_date_moves_its_tagged_block() -> None:
    env = "<env>\nWorking directory: /repo\nPlatform: linux\nToday's date: 2026-11-{day}\n</env>"
    memories = Memories()
    for day in (10, 11, 12):
        system = "You are a coding agent.\nBe careful with git.\n\n" + env.format(day=day) + "\n\nAlways run the tests."
        out = memories.apply(request(system, "hi")).body
    assert stable_text(out) == "You are a coding agent.\nBe careful with git.\n\nAlways run the tests."
    assert moved_block(out) == env.format(day=12)


def test_a_line_of_a_block_moves_alone_and_a_block_left_empty_moves_whole() -> None:
    text = "<doc>\na\nb\nCurrent time: 2026-11-29T10:00:00Z\nc\n</doc>\ntail line"
    assert units_of(text).whole({3}) == {3}
    text = "x1\nx2\nx3\nx4\nx5\n<doc>\nCurrent time: 2026-11-29T10:00:00Z\n</doc>"
    assert units_of(text).whole({6}) == {5, 6, 7}


def test_an_introduced_run_inside_a_document_ends_with_it() -> None:
    """A ``def f():`` line in a retrieved document introduces nothing past its ``</context>``: the
    time line after it moves alone and the document stays whole (it tore before: the fence of its
    code and its closing tag moved with the time line)."""
    document = "<context>\nFirst paragraph.\n\nSecond paragraph.\n\n    def f():\n        return 1  \n</context>"
    text = f"{document}\nCurrent time: 2026-11-29T14:03:11Z\nYou are a helpful assistant."
    assert units_of(text).whole({8}) == {8}
    memories = Memories()
    for second in (10, 11, 12):
        system = f"{document}\nCurrent time: 2026-11-29T14:03:{second}Z\nYou are a helpful assistant."
        out = memories.apply(request(system, "hi")).body
        if second == 10:
            continue  # first sight: nothing is known to vary
        assert stable_text(out) == f"{document}\nYou are a helpful assistant."
        assert moved_block(out) == f"Current time: 2026-11-29T14:03:{second}Z"


def test_what_a_label_introduces_stops_before_a_block() -> None:
    units = units_of("Notes:\none\n<doc>\ntwo\n\nthree\n</doc>")
    assert units.whole({1}) == {0, 1}
    assert units.whole({3}) == {3}


def test_first_sight_kinds_move_at_the_first_request() -> None:
    def environment(text: str) -> list[Span]:
        return [Span(m.start(), m.end(), "environment") for m in re.finditer(r"^cwd: .*$", text, re.M)]

    options = CanonOptions(detectors=(*BUILTIN_DETECTORS.values(), environment))
    memories = Memories()
    system = "You are an agent.\nRead before you write.\ncwd: /home/alice/project\nBe brief."
    out = memories.apply(request(system, "hi"), options).body
    assert stable_text(out) == "You are an agent.\nRead before you write.\nBe brief."
    assert moved_block(out) == "cwd: /home/alice/project"
    # A rule kind waits for its place to vary, as before.
    rule = CanonOptions(detectors=(regex_detector("cwd", r"^cwd: .*$"),))
    assert stable_text(Memories().apply(request(system, "hi"), rule).body) == system


def _tools(count: int) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": f"tool_{n:02d}", "parameters": {"type": "object"}}}
        for n in range(count)
    ]


def test_a_time_line_still_moves_on_the_turn_the_tools_grow() -> None:
    memories = Memories()
    instructions = "\n".join(f"Instruction {k}: keep the user's files safe." for k in range(6))
    turns = [f"question {n}" for n in range(6)]
    for n in range(1, 7):
        tools = _tools(28 if n < 5 else 32)
        system = f"{instructions}\nThe time is 2026-11-29 10:{n:02d}:00.\nAnswer briefly."
        out = memories.apply(request(system, *turns[:n], tools=tools)).body
        if n >= 2:
            assert "The time is" not in stable_text(out), n
            assert "The time is 2026-11-29" in moved_text(out), n


def test_a_restored_block_is_the_whole_block() -> None:
    """A conversation's next turn moves the same block to the same place, fences and all, even when
    the same fence lines occur in the stable text too."""
    memories = Memories()
    top = "You review code.\n```\nfence style\n```\nKeep answers short."
    bottom = "Answer about the code."

    def system(n: int) -> str:
        return f"{top}\n\n```python\ndef f{n}():\n    pass\n```\n\n{bottom}"

    for n in range(3):  # other conversations: the place varies
        memories.apply(request(system(n), f"q{n}"))
    first = memories.apply(request(system(9), "first")).body
    second = memories.apply(request(system(9), "first", "second"))
    assert stable_text(second.body) == f"{top}\n\n{bottom}"
    assert moved_block(first) == moved_block(second.body) == "```python\ndef f9():\n    pass\n```"
    # The block went back before the first question, so the turn extends what was forwarded.
    assert second.body["messages"][:3] == first["messages"]
    assert ("volatile_moved", "restored") in [(a.kind, a.detail) for a in second.actions]


def test_idempotent_and_deterministic_with_whole_blocks() -> None:
    memories, again = Memories(), Memories()
    for n in range(4):
        system = f"Be helpful.\nUse the docs.\n\n<doc>\n---\nline {n}\n---\n</doc>\n\nAnswer in English."
        once = memories.apply(request(system, "q")).body
        assert again.apply(request(system, "q")).body == once
    assert canonicalize(once, RELOCATE).body == once


def test_the_workflow_session_shape() -> None:
    session = DifyWorkflowSession(0, random.Random(0))
    body = session.next_request()
    assert body is not None
    system = body["messages"][0]["content"]
    assert "Here is the retrieved context:\n" in system and system.count("```python") == 2
    assert system.index("retrieved context") < system.index("When answer to user:")


def test_the_workflow_scenario_reaches_its_target_through_the_proxy() -> None:
    """``dify_workflow`` (retrieved documents and fenced code between two real instruction blocks):
    at least 40% of prompt tokens from the cache through the proxy, and better than direct."""
    from testbed.demo import run_demo

    result = run_demo(sessions=16, seed=0, scenarios="dify_workflow", progress=False)
    direct, proxied = result.direct["dify_workflow"], result.proxied["dify_workflow"]
    assert proxied.errors == 0 and direct.errors == 0
    assert proxied.hit_rate >= 0.40, (direct.hit_rate, proxied.hit_rate)
    assert proxied.prefill_tokens < direct.prefill_tokens
    assert proxied.actions["volatile_moved"] > 0
