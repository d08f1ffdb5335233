"""What the canonicalizer memoizes changes nothing: the same traffic with and without the memories.

- relocation on a text's memoized facts (``proxy.canon.textmemo``) against reading it line by line:
  request by request, over the benchmark's request shapes, over generated apps whose system prompts
  change line by line (dates, ids, environment blocks, fences, tags, lists, a user's name) in
  several tenants and conversations, and function by function on random line soups;
- learned volatility's prepared prompts and remembered matches against its earlier implementation
  (kept here as the reference), on sequences of prompts that share, change and lose lines.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from difflib import SequenceMatcher
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import shapes
from proxy.canon import CanonOptions, LearnedVolatility, ToolCallMemory, canonicalize
from proxy.canon import relocate as rl
from proxy.canon import textmemo as tm
from proxy.canon.layout import ForwardedLayouts
from proxy.canon.learned import FIRST_MATCH, MIN_MATCH, MIN_SHARE, line_hash
from proxy.canon.relocation import _skeleton
from proxy.canon.tools import ToolOrders
from proxy.canon.varying import VaryingPlaces
from proxy.canon.volatile import BUILTIN_DETECTORS, DetectionCache, detect_spans
from proxy.protocols import anthropic

DETECTORS = tuple(BUILTIN_DETECTORS.values())


def memories() -> dict[str, Any]:
    return {
        "learned": LearnedVolatility(),
        "tool_memory": ToolCallMemory(),
        "detection_cache": DetectionCache(),
        "varying": VaryingPlaces(),
        "layouts": ForwardedLayouts(),
        "tool_orders": ToolOrders(),
    }


class Twins:
    """Two canonicalizers' memories fed the same requests, one with a text memo."""

    def __init__(self, memo: tm.TextMemo | None = None) -> None:
        self.plain = memories()
        self.memoized = memories()
        self.memo = memo or tm.TextMemo()

    def check(self, body: dict[str, Any], namespace: str = "t", options: CanonOptions | None = None) -> list[str]:
        options = options or CanonOptions()
        expected = canonicalize(copy.deepcopy(body), options, namespace=namespace, **self.plain)
        found = canonicalize(copy.deepcopy(body), options, namespace=namespace, text_memo=self.memo, **self.memoized)
        assert found.body == expected.body
        assert [str(a) for a in found.actions] == [str(a) for a in expected.actions]
        assert (found.prefix_hash, found.stable_count, found.system_tail, found.inserted) == (
            expected.prefix_hash,
            expected.stable_count,
            expected.system_tail,
            expected.inserted,
        )
        return [str(a) for a in found.actions]


@pytest.mark.parametrize("name", shapes.SHAPE_NAMES)
def test_bench_shapes_canonicalize_the_same_with_the_text_memo(name: str) -> None:
    shape = shapes.build(name, 3000)
    twins = Twins()
    moved = 0
    for i in range(90):
        body = shape.body(i)
        if shape.path == "/messages":
            body = anthropic.AnthropicView.of(body, ToolOrders(), "t").chat
        moved += any(a.startswith("volatile_moved") for a in twins.check(body))
    if name in ("dify", "openwebui", "claude-code"):
        assert moved  # the shape exercises relocation


# -- generated apps -------------------------------------------------------------------------------

PARAGRAPHS = [
    "You are a support assistant for an online shop. Answer in the customer's language.",
    "Rules:\n- Be brief.\n- Never promise refunds.\n- Escalate legal questions.",
    '```json\n{"order": "id", "status": "open"}\n```',
    "<instructions>\nFollow the policy below.\nCite the policy section.\n</instructions>",
    "Steps to follow:\n1. Greet.\n2. Ask for the order id.\n3. Look it up.",
    "---",
    "你是一个专业的翻译助手，请把用户的内容翻译成英文。\n保持原文的格式。",
    "## Output format\nReturn JSON only.\n\n## Tone\nFriendly.",
    "Here is useful information about the environment you are running in:\n<env>\nWorking directory: "
    "/home/dev/app\nIs directory a git repo: Yes\nPlatform: linux\nToday's date: 2026-11-29\n</env>",
    "gitStatus: snapshot\nCurrent branch: main\n\nStatus:\n M src/app.py\n?? notes.txt\n\nRecent commits:\n"
    "a1b2c3d Fix the retry loop\ne4f5a6b Add the export",
    "<context>\nchunk about shipping\nchunk about returns\n</context>",
    "   indented line with trailing spaces   \n\tand a tab",
    "Windows line\r\nwith CRLF\r\n",
    "",
]
VARYING = [
    lambda r, i: f"Current time: 2026-12-02 {i % 24:02d}:{r.randrange(60):02d}:{r.randrange(60):02d}",
    lambda r, i: f"当前时间：2026年12月{1 + i % 28}日 {r.randrange(24)}:{r.randrange(60):02d}",
    lambda r, i: f"request id req_{r.getrandbits(48):012x}",
    lambda r, i: f"session {r.getrandbits(32):08x}-e29b-41d4-a716-{r.getrandbits(48):012x}",
    lambda r, i: f"You are talking to {r.choice(['Alice', 'Bob', 'Chen Wei', 'Priya'])}.",
    lambda r, i: f"The user asked: {r.choice(['where is my order', 'refund please', 'hello', 'help'])}",
    lambda r, i: "Today is " + r.choice(["Monday", "Tuesday", "Sunday"]),
]


class App:
    def __init__(self, rng: random.Random, name: str) -> None:
        self.rng = rng
        self.name = name
        self.paragraphs = [rng.choice(PARAGRAPHS) for _ in range(rng.randint(3, 9))]
        self.slots = sorted(rng.sample(range(len(self.paragraphs) + 1), rng.randint(0, 2)))
        self.kinds = [rng.randrange(len(VARYING)) for _ in self.slots]
        self.parts = rng.random() < 0.3

    def system(self, i: int) -> Any:
        rng = self.rng
        pieces = list(self.paragraphs)
        for slot, kind in reversed(list(zip(self.slots, self.kinds, strict=True))):
            pieces.insert(slot, VARYING[kind](rng, i))
        if rng.random() < 0.1:  # the app's prompt is edited
            pieces[rng.randrange(len(pieces))] = rng.choice(PARAGRAPHS)
        if rng.random() < 0.05:
            pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(PARAGRAPHS))
        text = "\n\n".join(pieces)
        if self.parts:
            cut = text.find("\n\n")
            return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}] if cut > 0 else text
        return text


def conversation(rng: random.Random, app: App, number: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"({app.name} {number}) question {turn}: {rng.random():.3f}"})
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    messages.append({"role": "user", "content": f"({app.name} {number}) and now?"})
    return messages


@pytest.mark.parametrize("seed", range(6))
def test_generated_apps_canonicalize_the_same_with_the_text_memo(seed: int) -> None:
    rng = random.Random(seed)
    twins = Twins()
    apps = [App(rng, f"app{k}") for k in range(4)]
    tenants = ["a", "b"]
    histories: dict[tuple[int, int], int] = {}
    for i in range(160):
        index = rng.randrange(len(apps))
        app = apps[index]
        number = rng.randrange(3)
        turns = histories.get((index, number), 0)
        histories[(index, number)] = turns + 1 if rng.random() < 0.8 else 0
        body = {
            "model": rng.choice(["m1", "m1", "m2"]),
            "messages": [{"role": "system", "content": app.system(i)}, *conversation(rng, app, number, turns)],
        }
        options = CanonOptions(relocate_target=rng.choice(["before_last_user", "before_last_user", "system_end"]))
        twins.check(body, rng.choice(tenants), options)


def test_a_small_memo_evicts_and_stays_the_same() -> None:
    rng = random.Random(7)
    twins = Twins(tm.TextMemo(max_lines=40, max_places=2))
    apps = [App(rng, f"app{k}") for k in range(5)]
    for i in range(150):
        app = apps[rng.randrange(len(apps))]
        twins.check(
            {"model": "m", "messages": [{"role": "system", "content": app.system(i)}, *conversation(rng, app, 0, 0)]}
        )


# -- function by function ----------------------------------------------------------------------

SOUP = st.lists(
    st.sampled_from(
        [
            "",
            "  ",
            "text line",
            "other words here",
            "text line",
            "```",
            "```python",
            "~~~",
            "````",
            "<doc>",
            "</doc>",
            "<item id='1'>",
            "</item>",
            "<br/>",
            "List:",
            "- one",
            "- two",
            "---",
            "Working directory: /srv/app",
            "Platform: linux",
            "Today's date: 2026-11-29",
            " M src/a.py",
            "a1b2c3d Fix it",
            "<env>",
            "</env>",
            "Status:",
            "src/main.py",
            "时间：2026-11-29 14:03",
            "line\r",
            "<context>",
            "retrieved 中文 chunk",
            "</context>",
        ]
    ),
    min_size=1,
    max_size=40,
)


def _facts(text: str) -> tuple[tm.TextScope, tm.TextFacts]:
    scope = tm.TextMemo().scope("t", DETECTORS)
    return scope, scope.facts(text, "")


@settings(max_examples=300, deadline=None)
@given(SOUP, st.sets(st.integers(0, 45), max_size=8), st.sets(st.integers(0, 45), max_size=5))
def test_line_functions_agree_with_relocate(lines: list[str], picked: set[int], other: set[int]) -> None:
    text = "\n".join(lines)
    _, facts = _facts(text)
    n = len(lines)
    moving = {i for i in picked if i < n}
    learned = frozenset(i for i in other if i < n)
    assert facts.spans == detect_spans(text, DETECTORS)
    assert facts.weak(text) == rl.weak_lines(lines)
    assert tm.widen(facts, moving, rl.weak_lines(lines)) == rl.widen(lines, moving, rl.weak_lines(lines))
    assert tm.bridge_blanks(facts, moving) == rl.bridge_blanks(lines, moving)
    assert tm.already_at_end(facts, moving) == rl.already_at_end(lines, moving)
    for bridge in (True, False):
        assert tm.runs(facts, sorted(moving), bridge_blank=bridge) == rl.runs(
            lines, sorted(moving), bridge_blank=bridge
        )
    if moving:
        assert tm.partition(facts, text, moving) == rl.partition_lines(lines, moving)
    detected = frozenset(i for i in moving if i not in learned)
    assert facts.skeleton(text, detected, learned) == _skeleton(lines, set(detected), set(learned))
    assert list(facts.learned_input(detected).hashes) == [
        line_hash(line) if line.strip() else 0 for i, line in enumerate(lines) if i not in detected
    ]


@settings(max_examples=200, deadline=None)
@given(
    SOUP,
    st.lists(
        st.tuples(
            st.integers(0, 45),
            st.sampled_from(
                ["x: 1", "", "```", "<doc>", "Mon 14:03", "a", "中文 ü 14:03:11", "<context>", "x</context>"]
            ),
        )
    ),
)
def test_a_text_filled_into_a_place_has_the_facts_of_the_text_read_whole(lines: list[str], edits: list[Any]) -> None:
    memo = tm.TextMemo()
    scope = memo.scope("t", DETECTORS)
    scope.facts("\n".join(lines), "place")
    for position, replacement in edits:
        if position < len(lines):
            lines = [*lines[:position], replacement, *lines[position + 1 :]]
        text = "\n".join(lines)
        assert_read_as_whole(memo, text)


def assert_read_as_whole(memo: tm.TextMemo, text: str) -> None:
    """The facts ``memo`` gives ``text`` at its place are those of the text read whole."""
    found = memo.scope("t", DETECTORS).facts(text, "place")
    whole = tm.TextMemo().scope("t", DETECTORS).facts(text, "")
    assert found.n == whole.n
    assert [found.start(i) for i in range(found.n + 1)] == [whole.start(i) for i in range(whole.n + 1)]
    assert list(found.hashes) == list(whole.hashes)
    assert (found.spans, found.detected) == (whole.spans, whole.detected)
    assert found.weak(text) == whole.weak(text)
    assert found.index == whole.index
    assert found.hash_set() == whole.hash_set()
    # Every line the place's texts ever held, the lines gone from the holes among them.
    asked = set(memo._places[next(iter(memo._places))].facts.hashes) | set(whole.hashes) | {1, 2}
    assert {h for h in asked if found.holds(h)} == {h for h in asked if whole.holds(h)}


# Lines of one length (so a text holding one in place of another has every offset the same): a
# filled text of the same shape shares its spans and line indices with the place's last one.
SAME_LENGTH = [
    line.ljust(20)[:20]
    for line in (
        "Mon 14:03:11 2026-01",
        "Tue 09:15:42 2026-02",
        "a1b2c3d Fix it again",
        " M src/a.py",
        "```",
        "<doc>",
        "</doc>",
        "x: 1",
        "plain words here ok",
        "other words here ok",
        "<context>",
        "",
        "List:",
        "- one",
        "Today's date: 2026-11",
        "时间：2026-11-29 14:03",
        "时间：2026-11-30 09:41",
        "text line",
        "see ratio 3:4 here",
        "see ratio 3 4 here",
        "a1b2c3d Fix it",
        "e4f5a6b Add it",
    )
]


@settings(max_examples=200, deadline=None)
@given(SOUP, st.integers(0, 45), st.lists(st.sampled_from(SAME_LENGTH), min_size=2, max_size=12))
def test_a_text_of_the_same_shape_in_the_holes_has_the_facts_of_the_text_read_whole(
    lines: list[str], position: int, fills: list[str]
) -> None:
    position = min(position, len(lines))
    memo = tm.TextMemo()
    for fill in fills:
        assert_read_as_whole(memo, "\n".join([*lines[:position], fill, *lines[position:]]))


def _padded(*lines: str) -> list[str]:
    return [line.ljust(20) for line in lines]


# Each: the text's other lines, and the hole's lines in turn. The first two make the place (its text
# read whole, then the line that differs becomes its hole), the third is filled in and read, the
# fourth has the third's shape but differs in what the shape does not cover.
@pytest.mark.parametrize(
    ("lines", "position", "fills"),
    [
        # The hole's ':' is the text's only one: the environment detector reads the lines, or none.
        (
            ["a1b2c3d Fix it", " M src/a.py", "text line"],
            2,
            _padded("see ratio 7 8 here", "see ratio 9 0 here", "see ratio 3:4 here", "see ratio 3 4 here"),
        ),
        # A fact's text counts (one fact repeated is no environment): a fact in a hole is read afresh.
        (
            ["a1b2c3d Fix it", "text line", "", "Platform: linux"],
            1,
            _padded("0000000 Zero it", "1111111 One it", "a1b2c3d Fix it", "e4f5a6b Add it"),
        ),
        # Repeated lines are weak: a hole repeating another line, then not.
        (
            ["text line".ljust(20), "```", "x"],
            1,
            _padded("first words", "second words", "text line", "other words here"),
        ),
    ],
)
def test_what_the_shape_does_not_cover_is_read_afresh(lines: list[str], position: int, fills: list[str]) -> None:
    test_a_text_of_the_same_shape_in_the_holes_has_the_facts_of_the_text_read_whole.hypothesis.inner_test(  # type: ignore[attr-defined]
        lines, position, fills
    )


def test_relocation_on_texts_of_the_same_shape_is_the_same_as_without_the_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reshaped = 0
    original = tm.TextFacts.reshaped

    def counted(self: tm.TextFacts, *args: Any) -> tm.TextFacts:
        nonlocal reshaped
        reshaped += 1
        return original(self, *args)

    monkeypatch.setattr(tm.TextFacts, "reshaped", counted)
    rng = random.Random(11)
    twins = Twins()
    head = "You are a support assistant.\nRules:\n- Be brief.\n- Cite sources.\n"
    tail = "\n<env>\nWorking directory: /srv/app\nPlatform: linux\n</env>\n```\ncode\n```\na1b2c3d Fix it\nThe end."
    for i in range(300):
        # Mostly a clock that ticks; now and then a line of the same length that reads otherwise.
        fill = SAME_LENGTH[i % 2] if rng.random() < 0.7 else rng.choice(SAME_LENGTH)
        fill = fill.replace("14:03:11", f"{i % 24:02d}:{i % 60:02d}:{(7 * i) % 60:02d}")
        system = head + fill + tail
        turns = rng.randrange(3)
        twins.check(
            {
                "model": "m",
                "messages": [{"role": "system", "content": system}, *conversation(rng, App(rng, "a"), 0, turns)],
            }
        )
    assert reshaped > 50


def test_tenants_do_not_share_what_the_memo_holds() -> None:
    memo = tm.TextMemo()
    text = "You are a helpful assistant.\nAnswer briefly."
    first = memo.scope("a", DETECTORS).facts(text, "p")
    memo.scope("a", DETECTORS).facts(text, "p")  # seen twice: kept for tenant a
    assert memo.scope("a", DETECTORS).facts(text, "p") is not None
    other = memo.scope("b", DETECTORS).facts(text, "p")
    assert other is not first
    assert set(first.keys).isdisjoint(other.keys)  # lines are keyed apart per tenant too


def _stable_system(body: dict[str, Any], twins: Twins, namespace: str) -> str:
    found = canonicalize(
        copy.deepcopy(body), CanonOptions(), namespace=namespace, text_memo=twins.memo, **twins.memoized
    )
    assert any(str(a).startswith("volatile_moved") for a in found.actions)
    content = found.body["messages"][0]["content"]
    assert isinstance(content, str)
    return content


def test_a_clock_moved_out_of_an_unchanged_prompt_leaves_the_same_string() -> None:
    """The stable text a place's split cut is the string cut last time, where it is equal: what was
    made of it (its UTF-8 form) is not made again. Equal text only, and one tenant's only (the
    memory and its bound: tests/test_recurring_texts.py)."""
    shape = shapes.build("dify", 3000)
    twins = Twins()
    for i in range(3):
        twins.check(shape.body(i))  # the clock is seen to vary: it moves from now on
    first = _stable_system(shape.body(3), twins, "t")
    second = _stable_system(shape.body(4), twins, "t")
    assert second == first and second is first
    # Another tenant's equal text is its own string.
    for i in range(3):
        twins.check(shape.body(i), "other")
    assert _stable_system(shape.body(5), twins, "other") == first
    assert _stable_system(shape.body(6), twins, "other") is not first
    # A changed prompt gives its own text (once its clock is seen to vary), remembered in turn.
    changed = [shape.body(i) for i in range(7, 12)]
    for body in changed:
        body["messages"][0]["content"] = body["messages"][0]["content"].replace("expert", "seasoned", 1)
    for body in changed[:3]:
        twins.check(body)
    third = _stable_system(changed[3], twins, "t")
    assert third != first and "seasoned" in third
    assert _stable_system(changed[4], twins, "t") is third


# -- learned volatility against its earlier implementation -----------------------------------------


class ReferenceTemplate:
    def __init__(self, history: int) -> None:
        self.recent: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=history)
        self.core: frozenset[int] = frozenset()

    def add(self, digest: int, sequence: tuple[int, ...]) -> None:
        self.recent.append((digest, sequence))
        self.core = frozenset.intersection(*(frozenset(s) for _, s in self.recent))

    def unaligned(self, digest: int, sequence: tuple[int, ...]) -> set[int]:
        distinct: dict[int, tuple[int, ...]] = {}
        for known, lines in self.recent:
            distinct.setdefault(known, lines)
        out: set[int] = set()
        for other in (d for d in distinct if d != digest):
            aligned = _aligned(sequence, distinct[other])
            out.update(i for i in range(len(sequence)) if i not in aligned)
        return out


def _aligned(current: tuple[int, ...], other: tuple[int, ...]) -> set[int]:
    head = 0
    limit = min(len(current), len(other))
    while head < limit and current[head] == other[head]:
        head += 1
    tail = 0
    while tail < limit - head and current[-1 - tail] == other[-1 - tail]:
        tail += 1
    aligned = set(range(head)) | set(range(len(current) - tail, len(current)))
    middle, known = current[head : len(current) - tail], other[head : len(other) - tail]
    if middle and known:
        for start, _, size in SequenceMatcher(None, middle, known, autojunk=False).get_matching_blocks():
            aligned.update(range(head + start, head + start + size))
    return aligned


class ReferenceLearned:
    """LearnedVolatility before prepared prompts and remembered matches (one app key)."""

    def __init__(self, history: int = 8, per_app: int = 32) -> None:
        self.templates: list[ReferenceTemplate] = []
        self.history = history
        self.per_app = per_app

    def observe(self, lines: list[str]) -> set[int]:
        hashes = [line_hash(line) if line.strip() else 0 for line in lines]
        positions = [i for i, h in enumerate(hashes) if h]
        if not positions:
            return set()
        sequence = tuple(hashes[i] for i in positions)
        digest = hash(sequence)
        template = self._match(frozenset(sequence))
        if template is None:
            template = ReferenceTemplate(self.history)
            self.templates.insert(0, template)
            del self.templates[self.per_app :]
            volatile: set[int] = set()
        else:
            volatile = {positions[i] for i in template.unaligned(digest, sequence)}
            if self.templates[0] is not template:
                self.templates.remove(template)
                self.templates.insert(0, template)
        template.add(digest, sequence)
        return volatile

    def _match(self, current: frozenset[int]) -> ReferenceTemplate | None:
        best, best_score = None, (0, 0.0)
        for template in self.templates:
            if not template.core:
                continue
            shared = len(template.core & current)
            settled = shared >= MIN_MATCH * len(template.core)
            if len(template.recent) == 1:
                settled = settled or shared >= FIRST_MATCH * max(len(template.core), len(current))
            if not settled or shared < MIN_SHARE * len(current):
                continue
            score = (shared, shared / len(template.core))
            if score > best_score:
                best, best_score = template, score
        return best


@pytest.mark.parametrize("seed", range(8))
def test_learned_volatility_observes_as_it_did(seed: int) -> None:
    rng = random.Random(seed)
    bases = [[f"app {a} line {k}" for k in range(rng.randint(3, 30))] for a in range(4)]
    reference = ReferenceLearned(history=rng.choice([2, 4, 8]), per_app=rng.choice([2, 32]))
    learned = LearnedVolatility(history=reference.history, templates_per_app=reference.per_app)
    for i in range(400):
        lines = list(rng.choice(bases))
        for _ in range(rng.choice([0, 0, 0, 1, 2, 5])):
            lines[rng.randrange(len(lines))] = f"varying {rng.randrange(6)}"
        if rng.random() < 0.1:
            lines.insert(rng.randrange(len(lines) + 1), "")
        if rng.random() < 0.05:
            lines = lines[: rng.randrange(1, len(lines) + 1)]
        assert learned.observe("app", lines) == reference.observe(lines), i


# -- the detectors' prefilters ---------------------------------------------------------------------


def _line_kind_unfiltered(line: str) -> int:
    """``volatile._line_kind`` as it was, every pattern tried on every line."""
    from proxy.canon import volatile as vo

    stripped = line.strip()
    if not stripped:
        return vo._BLANK
    if vo._ENV_KEY.match(line) or vo._PATH_VALUE.match(line) or vo._COMMIT.match(line) or vo._PORCELAIN.match(line):
        return vo._FACT
    if vo._FILE_PATH.match(line) or vo._PARENTHESIZED.match(line):
        return vo._PATH
    if vo._NUMBERED_COMMIT.match(line):
        return vo._LISTED
    if stripped.endswith(":") and len(stripped) <= vo._HEADER_MAX_CHARS:
        return vo._HEADER
    return vo._OTHER


LINE_CHARS = st.text(alphabet="0123456789abcdef:：/.\\()=-月日年号点 aZTM?!├─│\t", max_size=30)


NUMBERED = st.from_regex(r"\A[ •*-]{0,3}[0-9]{5,14}[ x]{0,2}[a-z]{0,3}\Z")


@settings(max_examples=2000, deadline=None)
@given(st.one_of(LINE_CHARS, NUMBERED, st.sampled_from([line for p in PARAGRAPHS for line in p.split("\n")])))
def test_prefilters_leave_the_detectors_as_they_were(line: str) -> None:
    from proxy.canon import volatile as vo

    assert vo._line_kind(line) == _line_kind_unfiltered(line)
    unfiltered = [m.group(0) for m in vo._DATETIME.finditer(line)]
    if vo._DATE_MARK.search(line) is None:
        assert unfiltered == []
    if vo._ASCII_DIGIT.search(line) is None:
        assert [m.group(0) for m in vo._REQUEST_ID.finditer(line) if any(c.isdigit() for c in m.group(0))] == []
    if "-" not in line:
        assert list(vo._UUID.finditer(line)) == []
