"""Moved text is whole units of the client's text (``proxy.canon.units``).

The three shapes are written as the clients build them: Continue CLI's ``baseSystemMessage``
(extensions/cli/src/systemMessage.ts: a ``Notes:`` list, ``<env>``, then ``<context name=...>``
elements whose text starts on the tag's line), a pydantic-ai agent whose dynamic instructions hold
the working directory, the time and ``git status --short`` (instructions joined by a blank line),
and Claude Code's environment block and ``gitStatus:`` section. The property test builds random
nestings of labels, tags, fences, lists and headings, knows the units it built, and checks what
relocation delivers against them.
"""

# The clients' own lines are long: they are written here as the clients send them.
# ruff: noqa: E501
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from proxy.canon import CanonOptions, LearnedVolatility, VaryingPlaces, canonicalize
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.units import ELEMENT, GROUP, LINE, LISTING, SECTION, Units, units_of

OPTIONS = CanonOptions()


class Proxy:
    """A canonicalizer's memories across requests, as the proxy keeps them."""

    def __init__(self) -> None:
        self.learned = LearnedVolatility()
        self.varying = VaryingPlaces()
        self.layouts = ForwardedLayouts()

    def send(self, body: dict[str, Any]) -> dict[str, Any]:
        result = canonicalize(
            body, OPTIONS, namespace="t", learned=self.learned, varying=self.varying, layouts=self.layouts
        )
        return result.body


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for number, turn in enumerate(turns):
        if number:
            messages.append({"role": "assistant", "content": f"answer {number}"})
        messages.append({"role": "user", "content": turn})
    return {"model": "m", "messages": messages}


def delivered_system(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "system"]


def assert_whole(sent: str, body: dict[str, Any]) -> None:
    """Each system message delivered is lines of the client's text in its order; together they hold
    every line once; what left the first one tears no unit."""
    lines = sent.split("\n")
    delivered = delivered_system(body)
    assert sorted(line for text in delivered for line in text.split("\n") if line.strip()) == sorted(
        line for line in lines if line.strip()
    )
    moving = _moved_lines(lines, delivered[0].split("\n"))
    assert units_of(sent).torn(moving) == []


def _moved_lines(lines: list[str], stable: list[str]) -> set[int]:
    """The lines of ``lines`` not in ``stable`` (a subsequence of it, matched in order)."""
    kept = iter(enumerate(lines))
    stayed = set()
    for line in stable:
        for index, candidate in kept:
            if candidate == line:
                stayed.add(index)
                break
        else:
            raise AssertionError(f"{line!r} is not in the client's order")
    return {i for i in range(len(lines)) if i not in stayed and lines[i].strip()}


# -- Continue CLI ---------------------------------------------------------------------------------


def continue_prompt(date: str, status: str) -> str:
    return f"""You are an agent in the Continue CLI. Given the user's prompt, you should use the tools available to you to answer the user's question.

Notes:
1. IMPORTANT: You should be concise, direct, and to the point, since your responses will be displayed on a command line interface.
2. When relevant, share file names and code snippets relevant to the query
Here is useful information about the environment you are running in:
<env>
Working directory: /home/dev/calc
Is directory a git repo: true
Platform: linux
Today's date: {date}
</env>

As you answer the user's questions, you can use the following context:

<context name="directoryStructure">Below is a snapshot of this project's file structure at the start of the conversation. This snapshot will NOT update during the conversation. It skips over .gitignore patterns.

./calc.py
./README.md
</context>
<context name="gitStatus">This is the git status at the start of the conversation. Note that this status is a snapshot in time, and will not update during the conversation.

{status}
</context>
<context name="commitSignature">When creating commits using any CLI or tool, include the following in the commit message:
Generated with [Continue](https://continue.dev)

Co-Authored-By: Continue <noreply@continue.dev>
</context>
"""


def test_continue_git_status_moves_with_its_context_element() -> None:
    proxy = Proxy()
    statuses = ["M calc.py", "M calc.py\n?? test_calc.py", "M calc.py\nM test_calc.py\n?? notes.md"]
    for turn, status in enumerate(statuses):
        sent = continue_prompt("2026-12-04", status)
        out = proxy.send(chat(sent, *[f"step {n}" for n in range(turn + 1)]))
        assert_whole(sent, out)
        stable = delivered_system(out)[0]
        # The element is delivered whole where it is delivered: never an empty wrapper.
        assert ('<context name="gitStatus">' in stable) == (status.split("\n")[-1] in stable)
        # The notes never varied: they stay where the client put them.
        assert "Notes:\n1. IMPORTANT" in stable


def test_continue_date_moves_alone_out_of_env() -> None:
    units = units_of(continue_prompt("2026-12-04", "M calc.py"))
    lines = continue_prompt("2026-12-04", "M calc.py").split("\n")
    date = next(i for i, line in enumerate(lines) if line.startswith("Today's date:"))
    assert units.whole({date}) == {date}  # a key: value line, a unit of its own
    status = next(i for i, line in enumerate(lines) if line == "M calc.py")
    whole = units.whole({status})
    assert lines[min(whole)].startswith('<context name="gitStatus">') and lines[max(whole)] == "</context>"


# -- pydantic-ai ----------------------------------------------------------------------------------

STATIC = "You are a careful coding assistant. Use the tools to read files before changing them."


def pydantic_ai_prompt(now: str, status: str) -> str:
    dynamic = f"Working directory: /srv/app\nCurrent time: {now}\nGit status:\n{status}"
    return f"{STATIC}\n\n{dynamic}"


def test_pydantic_ai_git_status_keeps_its_label() -> None:
    proxy = Proxy()
    runs = [("2026-12-04 09:00:01", "clean"), ("2026-12-04 09:00:09", "clean"), ("2026-12-04 09:01:30", "M app.py")]
    for turn, (now, status) in enumerate(runs):
        sent = pydantic_ai_prompt(now, status)
        out = proxy.send(chat(sent, *[f"task {n}" for n in range(turn + 1)]))
        assert_whole(sent, out)
        for text in delivered_system(out):
            lines = text.strip("\n").split("\n")
            assert lines[0] != status, "the status arrived without its label"
            assert lines[-1] != "Git status:", "the label arrived without its status"


# -- LangChain RAG template ----------------------------------------------------------------------


def langchain_rag_prompt(now: str, context: str, blank: str = "") -> str:
    """A ``ChatPromptTemplate`` system message as LangChain apps write it: a date partial, then the
    retrieved documents (``"\\n\\n".join(doc.page_content ...)``) after ``Context:`` (``blank``: a blank
    line between the label and the documents)."""
    return (
        "You are an assistant for questions about a small software repository.\n"
        f"Current date and time: {now}\n"
        "\n"
        "Use the following pieces of retrieved context to answer the question.\n"
        "\n"
        f"Context:\n{blank}{context}"
    )


README = "# tiny-calc\n\nA tiny calculator used to benchmark coding agents."
CODE = "def f(a, b):\n    return a + b"


def test_a_label_introduces_the_heading_or_label_after_it() -> None:
    """A retrieved document that opens with a Markdown heading, or with a line ending with ``:`` (code),
    is what ``Context:`` introduces, on the next line or after a blank line: moved without it, the
    label reads as introducing nothing."""
    for blank, documents in itertools.product(("", "\n"), (f"{README}\n\n\n{CODE}\n", f"{CODE}\n\n\n{README}\n")):
        text = langchain_rag_prompt("12/05/2026, 02:23:01", documents, blank)
        lines = text.split("\n")
        label = lines.index("Context:")
        documents = {i for i in range(label + 1, len(lines)) if lines[i].strip()}
        units = units_of(text)
        group = next(u for u in units.units() if u.first == label)
        assert group.kind == GROUP and group.last > label, (blank, group)  # its first document, at least
        assert [(u.kind, u.first) for u in units.torn(documents)] == [(GROUP, label)]
        assert units.whole(documents) >= documents | {label}


def test_langchain_context_moves_with_its_label() -> None:
    proxy = Proxy()
    contexts = [f"{README}\n\n\n{CODE}\n", f"{CODE}\n\n\ndef g(a, b):\n    return a * b\n", f"{README}\n\nRun it.\n"]
    for turn in range(6):
        sent = langchain_rag_prompt(f"12/05/2026, 02:23:{turn:02d}", contexts[turn % 3])
        out = proxy.send(chat(sent, *[f"question {n}" for n in range(turn + 1)]))
        assert_whole(sent, out)
        for text in delivered_system(out):
            assert text.rstrip("\n").split("\n")[-1] != "Context:", (turn, "the label arrived without its documents")


# -- Claude Code ----------------------------------------------------------------------------------


def claude_code_prompt(date: str, status: str, commits: str) -> str:
    return f"""You are Claude Code, Anthropic's official CLI for Claude.
You are an interactive CLI tool that helps users with software engineering tasks.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/dev/shop
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.8.0-45-generic
Today's date: {date}
</env>
You are powered by the model named Sonnet 4.5. The exact model ID is claude-sonnet-4-5-20250929.

Assistant knowledge cutoff is January 2025.

gitStatus: This is the git status at the start of the conversation. Note that this status is a snapshot in time, and will not update during the conversation.
Current branch: main

Main branch (you will usually use this for PRs): main

Status:
{status}

Recent commits:
{commits}"""


def test_claude_code_git_status_groups_stay_whole() -> None:
    proxy = Proxy()
    commits = ["5949420 Initial commit"]
    shapes = [("(clean)", 0), ("M cart.py", 0), ("M cart.py\n?? tests/test_cart.py", 1), ("(clean)", 2)]
    for turn, (status, commit) in enumerate(shapes):
        if commit:
            commits.insert(0, f"{commit}a1b2c{commit} Add the cart total")
        sent = claude_code_prompt("2026-12-04", status, "\n".join(commits))
        out = proxy.send(chat(sent, *[f"task {n}" for n in range(turn + 1)]))
        assert_whole(sent, out)
        stable = delivered_system(out)[0]
        assert ("Status:" in stable) == (status.split("\n")[0] in stable)
        assert ("Recent commits:" in stable) == (commits[0] in stable)


def test_a_key_value_line_opening_a_paragraph_goes_with_all_it_heads() -> None:
    """mistral-vibe 3.0.2's git context (never run before by the project): a ``key: value`` line whose
    value says what the lines under it are. The git lines moved, it stayed, reading as nothing; as
    the opening of its paragraph it goes along when every line it heads moves, and only then."""
    text = (
        "Absolute path: /tmp/repo\n\n"
        "gitContext: This is Git repository metadata from the start of the conversation. Note that this "
        "context is a snapshot in time, and will not update during the conversation.\n"
        "Current branch: main\nMain branch (you will usually use this for PRs): main\n"
        "Recent commits:\n929f370 Initial commit\n\n"
        "<env>\nWorking directory: /tmp/repo\nPlatform: linux\nToday's date: 2026-12-05\n</env>\n"
    )
    units = units_of(text)
    assert units.whole({3, 4, 5, 6}) == {2, 3, 4, 5, 6}
    assert [unit.first for unit in units.torn({3, 4, 5, 6})] == [2]  # what the proxy did before
    assert units.whole({4}) == {4}  # a part of what it heads: it stays
    assert units.whole({11}) == {11}  # the date moves alone out of <env>
    assert units.whole({9}) == {9}  # the opening line varies itself: it moves alone
    assert units.whole({10, 11}) == set(range(8, 13))  # all the run: the element's whole content


# -- random nestings --------------------------------------------------------------------------------


@dataclass
class Built:
    """A text built line by line, with the units the builder made (first, last, kind, framing)."""

    lines: list[str] = field(default_factory=list)
    units: list[tuple[int, int, str, tuple[int, ...]]] = field(default_factory=list)
    headings: list[tuple[int, int]] = field(default_factory=list)  # (line, level)
    serial: int = 0

    def close_sections(self) -> None:
        """A heading's section runs to the next heading of its level or above, or the text's end."""
        for number, (line, level) in enumerate(self.headings):
            end = next((at for at, other in self.headings[number + 1 :] if other <= level), len(self.lines))
            last = end - 1
            while not self.lines[last].strip():
                last -= 1
            self.units.append((line, last, SECTION, (line,)))

    def line(self, text: str) -> int:
        self.lines.append(text)
        return len(self.lines) - 1

    def fresh(self, word: str) -> str:
        self.serial += 1
        return f"{word} {self.serial}"


def _value(rng: random.Random, built: Built, request: int) -> str:
    """A plain line, or (a third of the time) one that varies from request to request."""
    if rng.random() < 0.3:
        return f"{built.fresh('Current time')}: 2026-12-04 {request % 24:02d}:{request * 7 % 60:02d}:11"
    return built.fresh("steady line of text")


def _build(rng: random.Random, built: Built, depth: int, request: int, seed: int, wrapped: bool = False) -> None:
    """One unit (``wrapped``: inside an element, where a heading's section would end at its tag)."""
    kinds = ["label", "tag", "fence", "list", "pair"] + ([] if wrapped else ["heading"])
    kind = rng.choice(kinds if depth < 3 else ["pair", "plain"])
    if kind == "label":
        head = built.line(f"{built.fresh('Label')}:")
        first_line = built.line(_value(rng, built, request))
        built.line(f"?? file_{seed}_{request}.py" if rng.random() < 0.5 else built.fresh("listed"))
        built.units.append((head, first_line + 1, GROUP, (head,)))
        built.line("")  # what a label introduces runs to a blank line
    elif kind == "tag":
        name = f"tag{built.serial}"
        built.serial += 1
        head = built.line(f'<{name} name="x">')
        for _ in range(rng.randint(1, 3)):
            _build(rng, built, depth + 1, request, seed, wrapped=True)
        tail = built.line(f"</{name}>")
        built.units.append((head, tail, ELEMENT, (head, tail)))
    elif kind == "fence":
        opener = "`" * (3 + built.serial % 3)
        built.serial += 1
        head = built.line(f"{opener}text")
        built.line(built.fresh("code line"))
        built.line(_value(rng, built, request))
        tail = built.line(opener)
        built.units.append((head + 1, tail - 1, LISTING, ()))  # code between blank lines moves whole
    elif kind == "list":
        for _ in range(rng.randint(2, 3)):
            built.line(f"- {_value(rng, built, request)}")
    elif kind == "heading":
        head = built.line(f"{'#' * (depth + 1)} {built.fresh('Heading')}")
        built.headings.append((head, depth + 1))
        _build(rng, built, depth + 1, request, seed)
    elif kind == "pair":
        built.line(f"{built.fresh('Key')}: {_value(rng, built, request)}")
    else:
        built.line(built.fresh("plain sentence"))
    if depth == 0:
        built.line("")


def random_prompt(seed: int, request: int) -> Built:
    rng = random.Random(seed)  # the same structure on every request of a seed; values by request
    built = Built()
    built.line(f"You are assistant {seed}. Answer briefly.")
    built.line("")
    for _ in range(rng.randint(2, 5)):
        _build(rng, built, 0, request, seed)
    built.line("Always cite your sources.")
    built.close_sections()
    return built


def test_random_nestings_deliver_whole_units_in_order() -> None:
    for seed in range(60):
        proxy = Proxy()
        for request in range(4):
            built = random_prompt(seed, request)
            sent = "\n".join(built.lines)
            out = proxy.send(chat(sent, *[f"question {n}" for n in range(request + 1)]))
            delivered = delivered_system(out)
            # Nothing lost, nothing added: every line once, on one side.
            assert sorted(line for text in delivered for line in text.split("\n") if line.strip()) == sorted(
                line for line in built.lines if line.strip()
            ), seed
            moving = _moved_lines(built.lines, delivered[0].split("\n"))
            for text in delivered[1:]:
                _moved_lines(built.lines, text.split("\n"))  # each in the client's order
            # The builder's own units: a framing line moves exactly when all its content does.
            for first, last, kind, framing in built.units:
                inside = {i for i in range(first, last + 1) if built.lines[i].strip()}
                content = inside - set(framing)
                if kind == LISTING:
                    assert not (inside & moving) or inside <= moving, (seed, request, first)
                    continue
                for line in framing:
                    assert (line in moving) == (bool(content) and content <= moving), (seed, request, kind, first)
            assert units_of(sent).torn(moving) == []


def test_moving_sets_made_whole_tear_nothing() -> None:
    rng = random.Random(7)
    for seed in range(200):
        built = random_prompt(seed, seed)
        text = "\n".join(built.lines)
        units = units_of(text)
        moving = {i for i in range(len(built.lines)) if rng.random() < 0.15}
        whole = units.whole(moving)
        assert moving <= whole
        assert units.torn(whole) == []
        # Only lines of units the set touched are added: never a unit it did not touch.
        for unit in units.units():
            if unit.kind == LINE and unit.first not in moving and unit.first in whole:
                assert any(
                    u.first <= unit.first <= u.last and any(u.first <= m <= u.last for m in moving)
                    for u in units.units()
                    if u is not unit
                )


def test_the_tree_is_kept_by_the_text() -> None:
    text = continue_prompt("2026-12-04", "M calc.py")
    assert units_of(text) is units_of(str(text.encode().decode()))


def test_a_text_whose_values_changed_takes_the_tree_a_fresh_parse_gives() -> None:
    """A prompt whose clock ticks takes the tree of the one before it (no parse of its lines); the
    tree is the one parsing it afresh gives, whichever lines changed and however they read."""
    rng = random.Random(11)
    for seed in range(300):
        built = random_prompt(seed, 0)
        units_of("\n".join(built.lines))
        changed = list(built.lines)
        for index in rng.sample(range(len(changed)), k=rng.randint(1, 3)):
            line = changed[index]
            pick = rng.random()
            if pick < 0.25:  # a value within the line: reads alike
                changed[index] = line + str(rng.randint(0, 9)) if line.strip() else line
            elif pick < 0.5 and line:  # a character of the line, its length kept (a clock's digit, a colon)
                at = rng.randrange(len(line))
                changed[index] = line[:at] + ("x" if line[at] != "x" else ":") + line[at + 1 :]
            elif pick < 0.8:  # another kind of line: reads otherwise
                changed[index] = rng.choice(["Notes:", "- an item", "</context>", "```", "# Heading", ""])
            else:
                changed[index] = " " * rng.randint(1, 4) + line
        text = "\n".join(changed)
        fresh = Units(text)
        found = units_of(text)
        assert found.roots == fresh.roots, seed
        assert found.starts == fresh.starts and found.framing() == fresh.framing(), seed
