"""Relocation: the volatile lines of the leading system messages, moved behind the stable part.

Whole lines move, byte for byte (``relocate.partition_lines``). Which lines, and where to:

1. Candidates are the lines of detected spans (dates, ``<context>`` blocks, ids, user rules)
   and learned lines (seen to vary between an app's requests). A detected span proposes to
   move only once its place has been seen with another value (``varying``).
2. The conversation comes first (``layout``): a request that extends a prompt forwarded
   before with its lines in place keeps them there; a conversation whose block was inserted
   before a user turn gets the same lines inserted there again, even if what is detected or
   learned has changed since. Either way the turn extends what its backend already holds.
3. Otherwise proposed lines go to the default place: one system message just before (or
   after) the last user turn, or the end of the system message (``system_end``, and for
   a request with no user turn after the system prompt). A one-shot request whose user turn
   opens the way an earlier one of the app did (a template) gets them after that turn.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import xxhash

from proxy.canon import textmemo as tm
from proxy.canon.actions import Action
from proxy.canon.fingerprint import leading_system_count
from proxy.canon.layout import (
    Block,
    Digested,
    ForwardedLayouts,
    MovedLine,
    chain_header,
    extend,
    message_digest,
)
from proxy.canon.learned import LearnedVolatility, line_hash
from proxy.canon.querytemplate import restore_query_blocks
from proxy.canon.relocate import (
    already_at_end,
    bridge_blanks,
    lines_touched,
    partition_lines,
    runs,
    split_lines,
    weak_lines,
    widen,
)
from proxy.canon.textmemo import TextFacts, TextScope
from proxy.canon.units import units_of, whole_units
from proxy.canon.varying import VaryingPlaces
from proxy.canon.volatile import FIRST_SIGHT_KINDS, DetectionCache, Detector, Span, detect_spans
from proxy.openai import Resumption, extend_links, is_text_parts, same_text

# Mixed into a conversation's key (its stable system messages and first user turn), so that it never
# equals the chain of a forwarded prompt.
_CONVERSATION_MARK = 0x636F6E766572736E

# A mark no count of blocks written is near: where blocks are is looked for again.
_UNKNOWN_MARK = -(1 << 62)

# A user turn is a template when its first this-many characters, with more after them, are what the
# app sent in that place before: a human's question rarely opens with 256 characters seen before.
TEMPLATE_OPENING_CHARS = 256


@dataclass(frozen=True)
class Placement:
    """Where relocation sends what it moves (the engine's options, as relocation needs them)."""

    target: str
    restore_query_blocks: bool
    detectors: Sequence[Detector]


@dataclass
class Memories:
    """What relocation consults and updates; any may be None (then: stateless behaviour)."""

    learned: LearnedVolatility | None = None
    varying: VaryingPlaces | None = None
    layouts: ForwardedLayouts | None = None
    detection_cache: DetectionCache | None = None
    # What is derived from a system text seen before (only saves work: the outcome is the same).
    texts: TextScope | None = None


@dataclass
class Relocation:
    actions: list[Action]
    # Leading system messages that are stable (what a summary goes right after).
    stable_count: int
    # Volatile lines moved to the end of the last stable system message (system_end).
    system_tail: str = ""
    # Where the messages relocation made are (a block of moved lines), in the messages as they
    # leave it; None: not known here (restated questions were inserted too).
    inserted: tuple[int, ...] | None = ()
    # The system messages the client sent (its leading ones and those of its history), where the
    # layout memory knows them; None otherwise.
    sent_system: list[Any] | None = None


def relocate(
    body: dict[str, Any], messages: list[dict[str, Any]], placement: Placement, memories: Memories, namespace: str
) -> Relocation:
    """Relocate in place (``messages`` must be copies the caller owns)."""
    system_count = leading_system_count(messages)
    if system_count == 0:
        return Relocation([], 0)
    app_key = _app_key(namespace, body)
    layouts = memories.layouts
    if layouts is None:
        return _relocate(messages, placement, memories, app_key, system_count, None)
    layout = _Layout(layouts, chain_header(namespace, body), app_key)
    layout.resume(namespace, messages)
    sent_system = [*messages[:system_count], *layout.history_systems()]
    relocation = _relocate(messages, placement, memories, app_key, system_count, layout)
    layout.keep()
    relocation.sent_system = sent_system
    return relocation


def _relocate(
    messages: list[dict[str, Any]],
    placement: Placement,
    memories: Memories,
    app_key: str,
    system_count: int,
    layout: _Layout | None,
) -> Relocation:
    splits = [
        _split_message(messages[index], placement, memories, f"{app_key}\x00{index}", index)
        for index in range(system_count)
    ]
    actions = [Action("learned_volatile_lines", str(s.learned)) for s in splits if s is not None and s.learned]
    proposed = any(s is not None and s.moved for s in splits)
    candidates = any(s is not None and s.candidates for s in splits)

    if layout is not None and (candidates or layout.app_had_blocks()):
        if layout.continues(messages, system_count):
            # This conversation was forwarded with these very lines in place: moving them now would
            # cost the turn everything after them.
            if proposed:
                actions.append(Action("volatile_kept", "conversation"))
            layout.record_forwarded(messages)
            return Relocation(actions, system_count)
        # system_end: this model takes one system message (or is configured so): nothing is inserted.
        inserting = placement.target != "system_end"
        for position, forced in layout.restorations(messages, system_count, placement, memories) if inserting else ():
            trial = list(messages)
            outcome = _insert(trial, forced, position, placement, None, fresh=False)
            # Worth it only if the turn then extends what was forwarded: when the lines that stay
            # changed too, the old position saves nothing and the default place is decided afresh.
            if layout.continues(trial, outcome.stable_count):
                layout.record_block(messages, system_count, position, _moved_lines(forced))
                layout.record_forwarded(trial, outcome.stable_count)
                messages[:] = trial
                return Relocation(actions + outcome.actions, outcome.stable_count, inserted=outcome.inserted)
        if (
            inserting
            and proposed
            # A user turn after the first (where the last one is the first, the default place is the
            # conversation's start already).
            and system_count < _last_user_index(messages) < len(messages)
            and not layout.had_blocks(messages, system_count)
        ):
            # A conversation whose history is new here (compacted, a window that slid, a chat seen
            # first mid-way) whose moved lines the app's conversations began with, byte for byte:
            # at its start they are cached; before its last user turn they would be computed again.
            trial = list(messages)
            outcome = _insert(trial, splits, system_count, placement, None, fresh=True, target="conversation_start")
            if layout.continues(trial, outcome.stable_count + 1):
                layout.record_block(messages, system_count, system_count, _moved_lines(splits))
                layout.record_forwarded(trial, outcome.stable_count)
                messages[:] = trial
                return Relocation(actions + outcome.actions, outcome.stable_count, inserted=outcome.inserted)
        if inserting and any(s is not None and s.held for s in splits):
            kept = _moved_mid_conversation(messages, splits, system_count, placement, memories, layout)
            if kept is not None:
                return Relocation(actions + kept.actions, kept.stable_count, inserted=kept.inserted)
    if not proposed:
        # Recorded with or without candidates: lines learned later (another prompt of the app seen
        # since) must not move in a conversation that was forwarded with them in place.
        if layout is not None:
            layout.record_forwarded(messages)
        return Relocation(actions, system_count)
    if placement.target == "system_end" or not _has_user_after(messages, system_count):
        moved, system_tail = _move_to_system_end(messages, splits)
        if layout is not None:
            layout.record_forwarded(messages)
        return Relocation(actions + moved, system_count, system_tail)
    position, target = _fresh_position(messages, system_count, placement, layout)
    if target == "after_templated_user" and layout is not None:
        # Before the templated question, the block extends a prompt the app forwarded (another task
        # sent with this very system prompt, the block before its question): there it is cached, and
        # after the question it would cost the request the question too. The template's reason to go
        # after it holds where the block is new.
        trial = list(messages)
        outcome = _insert(trial, splits, position - 1, placement, None, fresh=True)
        if layout.continues(trial, outcome.stable_count + 1):
            layout.record_block(messages, system_count, position - 1, _moved_lines(splits))
            layout.record_forwarded(trial, outcome.stable_count)
            messages[:] = trial
            return Relocation(actions + outcome.actions, outcome.stable_count, inserted=outcome.inserted)
    outcome = _insert(messages, splits, position, placement, layout, fresh=True, target=target)
    return Relocation(actions + outcome.actions, outcome.stable_count, inserted=outcome.inserted)


def _moved_mid_conversation(
    messages: list[dict[str, Any]],
    splits: list[_Split | None],
    system_count: int,
    placement: Placement,
    memories: Memories,
    layout: _Layout,
) -> _Inserted | None:
    """Every candidate line moved, varied or not, when that makes a conversation in flight extend
    what it was forwarded as; None (nothing changed) otherwise.

    A system prompt that gains or changes lines mid-conversation (an app's memory block added, a
    document swapped) costs the turn everything after the change as sent: the tools and the whole
    history. Before the last user turn the lines cost only themselves, and the next turn finds them
    there again (``restorations``). A place first seen here has not varied for the app, but it has
    for this conversation, whose earlier turns went out without these lines. Taken only where this
    conversation (its first user turn) was forwarded before after the very system messages left
    behind (so the backend holds them, the tools and the history after them), while the system
    prompt as sent was not (or the request would have continued a forwarded prompt): the change is
    exactly the lines moved. A conversation this replica has not seen that way (it went out with
    the lines in place from another replica, or was forgotten) goes as sent."""
    last_user = _last_user_index(messages)
    if last_user >= len(messages):
        return None  # no user turn to put them before (a tool result last): system_end's case
    if not any(m.get("role") == "assistant" for m in islice(messages, system_count, last_user)):
        return None  # a conversation's first turn: nothing was forwarded that moving could keep
    block = tuple(
        (index, part, line)
        for index, split in enumerate(splits)
        if split is not None
        for part, line in split.candidate_lines()
    )
    if not block:
        return None
    forced = layout.split_again(messages, system_count, block, placement, memories)
    position = last_user + 1 if placement.target == "after_last_user" else last_user
    trial = list(messages)
    outcome = _insert(trial, forced, position, placement, None, fresh=True, target="mid_conversation")
    if not outcome.stable_count or not layout.forwarded_conversation(trial, outcome.stable_count):
        return None
    layout.record_block(messages, system_count, position, _moved_lines(forced))
    layout.record_forwarded(trial, outcome.stable_count)
    messages[:] = trial
    return outcome


def _app_key(namespace: str, body: dict[str, Any]) -> str:
    """(tenant, model): what is learned about a system prompt survives a changed tool set (a chat whose
    tools grow mid-conversation). Templates under one key are told apart by their lines (learned) and
    by their text around the candidates (varying places); the forwarded prompts' identity
    (``chain_header``) still covers the tools, which the backend renders."""
    return f"{namespace}\x00{body.get('model', '')}"


# -- splitting a system message -----------------------------------------------------------------


@dataclass
class _Split:
    """A system message's content with its moving lines taken out (``moved``: "" when none)."""

    stable: str | list[Any]
    moved: str = ""
    spans: list[Span] = field(default_factory=list)
    learned: int = 0
    # Lines that were candidates to move (detected or learned), moved or not.
    candidates: int = 0
    # The moving lines already sit behind the stable part (system_end has nothing to do).
    at_end: bool = False
    # (text part, line hash) of each moving line: what a later turn of the conversation moves again.
    lines: list[tuple[int, int]] = field(default_factory=list)
    # Where some candidate lines stay (their place has not varied yet): what finds (text part, line
    # hash) of every candidate line of that text, whole blocks, moved or not. Asked for only when a
    # conversation's system prompt changed mid-way, so found then.
    candidate_finders: list[Callable[[], list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Some candidate lines stay where the client put them."""
        return bool(self.candidate_finders)

    def candidate_lines(self) -> list[tuple[int, int]]:
        return [line for find in self.candidate_finders for line in find()]


# The line hashes to move in one text (each as often as it moved), or None: decide from detectors and memories.
Forced = Counter[int] | None


def _split_message(
    message: dict[str, Any],
    placement: Placement,
    memories: Memories,
    key: str,
    index: int,
    forced: dict[int, Counter[int]] | None = None,
) -> _Split | None:
    content = message.get("content")
    if isinstance(content, str):
        return _split_text(content, placement, memories, key, (index, 0), _forced(forced, 0))
    if is_text_parts(content):
        return _split_parts(content, placement, memories, key, index, forced)
    return None


def _forced(forced: dict[int, Counter[int]] | None, part: int) -> Forced:
    if forced is None:
        return None
    return forced.get(part, Counter())


def _split_text(
    text: str, placement: Placement, memories: Memories, key: str, where: tuple[int, int], forced: Forced = None
) -> _Split:
    if not text:
        return _Split(text)
    if memories.texts is not None:
        facts = memories.texts.facts(text, key)
        if forced is not None:
            return _split_forced_facts(text, facts, forced)
        return _split_facts(text, facts, memories, key, where)
    lines = split_lines(text)
    if forced is not None:
        return _split_forced(text, lines, forced)
    spans = detect_spans(text, placement.detectors, memories.detection_cache)
    detected = lines_touched(text, spans)
    learned_lines: set[int] = set()
    if memories.learned is not None:
        unaligned = _reindex(lines, detected, memories.learned.observe(key, _without(lines, detected)))
        if unaligned:
            # A region that varies, whole: over the lines too weak to anchor it (fences, rules, blank or
            # repeated lines), then the units it touches (``units``).
            # A unit's framing is never weak: it goes with its content, whole (``units``).
            tree = units_of(text)
            learned_lines = set(tree.whole(widen(lines, unaligned, weak_lines(lines) - tree.framing())))
    candidates = detected | learned_lines
    # The app is the template around the candidates: requests of two apps that share a model, and
    # text (a context prompt, an instruction), do not vary each other's places.
    skeleton = (
        _skeleton(lines, _with_their_units(text, detected), learned_lines)
        if memories.varying is not None and candidates
        else 0
    )
    place_key = f"{key}\x00{skeleton:x}"
    varied = _varied_spans(text, spans, memories.varying, place_key, where)
    moving = set(_varied_learned(lines, learned_lines, memories.varying, place_key, where))
    varied_lines = lines_touched(text, varied)
    if varied_lines:
        moving |= varied_lines
    # What moves is whole units: a label, a heading or a wrapper goes with all of its content.
    moving = bridge_blanks(lines, set(whole_units(text, moving)))
    held = not candidates <= moving
    finders = [lambda: _all_candidates(text, lines, detected, learned_lines, where[1])] if held else []
    if not moving:
        return _Split(text, learned=len(learned_lines), candidates=len(candidates), candidate_finders=finders)
    stable, moved = partition_lines(lines, moving)
    return _Split(
        stable,
        moved,
        varied,
        len(learned_lines),
        len(candidates),
        already_at_end(lines, moving),
        _line_ids(lines, moving, where[1]),
        finders,
    )


def _all_candidates(
    text: str, lines: list[str], detected: set[int], learned: set[int], part: int
) -> list[tuple[int, int]]:
    """(part, line hash) of every candidate line, made whole units, as they would move once varied."""
    return _line_ids(lines, bridge_blanks(lines, set(whole_units(text, learned | detected))), part)


def _split_facts(text: str, facts: TextFacts, memories: Memories, key: str, where: tuple[int, int]) -> _Split:
    """:func:`_split_text` on the text's facts (``textmemo``): the same split, without reading the
    text line by line."""
    spans = facts.spans
    detected = facts.detected
    learned_lines: frozenset[int] = frozenset()
    if memories.learned is not None:
        observed = memories.learned.observe_lines(key, facts.learned_input(detected))
        if observed:
            unaligned = frozenset(_reindex_around(detected, observed))

            def whole_regions() -> frozenset[int]:
                tree = units_of(text)
                return tree.whole(tm.widen(facts, set(unaligned), facts.weak(text) - tree.framing()))

            learned_lines = facts.cached(("learned lines", unaligned), whole_regions)
    candidates = detected | learned_lines
    skeleton = (
        facts.skeleton(text, _with_their_units(text, detected), learned_lines)
        if memories.varying is not None and candidates
        else 0
    )
    place_key = f"{key}\x00{skeleton:x}"
    varied = _varied_spans(text, spans, memories.varying, place_key, where)
    moving = set(_varied_learned_facts(text, facts, learned_lines, memories.varying, place_key, where))
    varied_lines: frozenset[int] = facts.cached(("touched", *varied), lambda: frozenset(facts.lines_touched(varied)))
    if varied_lines:
        moving |= varied_lines
    moving = set(whole_units(text, moving))
    held = not candidates <= moving
    finders = [lambda: _all_candidates_facts(text, facts, detected, learned_lines, where[1])] if held else []
    if not moving:
        return _Split(text, learned=len(learned_lines), candidates=len(candidates), candidate_finders=finders)
    planned, at_end, ids = _planned(facts, moving)
    stable, moved = tm.cut(facts, text, planned)
    # The string made when this place last cut this text: its UTF-8 form is made already.
    stable = same_text(stable, f"{key}\x00{where[1]}")
    return _Split(
        stable,
        moved,
        varied,
        len(learned_lines),
        len(candidates),
        at_end,
        [(where[1], line) for line in ids],
        finders,
    )


def _all_candidates_facts(
    text: str, facts: TextFacts, detected: frozenset[int], learned: frozenset[int], part: int
) -> list[tuple[int, int]]:
    """:func:`_all_candidates` on the text's facts."""
    return tm.line_ids(facts, tm.bridge_blanks(facts, set(whole_units(text, learned | detected))), part)


def _planned(facts: TextFacts, moving: set[int]) -> tuple[tm.Plan, bool, tuple[int, ...]]:
    """What moves (``moving`` with the blank lines between its lines) as runs, whether it already
    sits at the end, and the hashes of its lines."""

    def compute() -> tuple[tm.Plan, bool, list[int]]:
        bridged = tm.bridge_blanks(facts, moving)
        nonblank = sorted(i for i in bridged if not facts.facts[i].blank)
        return tm.plan(facts, bridged), tm.already_at_end(facts, bridged), nonblank

    # Which lines, by shape only (a text of the same shape shares it); their hashes are this text's.
    planned, at_end, nonblank = facts.cached(("plan", frozenset(moving)), compute)
    hashes = facts.hashes
    return planned, at_end, tuple(hashes[i] for i in nonblank)


def _reindex_around(excluded: frozenset[int], learned: set[int]) -> set[int]:
    """:func:`_reindex` without the lines: the ``i``-th line not excluded, for each ``i``."""
    if not excluded:
        return set(learned)
    skipped = sorted(excluded)
    out = set()
    for index in learned:
        line = index
        for gap in skipped:
            if gap <= line:
                line += 1
            else:
                break
        out.add(line)
    return out


def _varied_learned_facts(
    text: str,
    facts: TextFacts,
    learned: frozenset[int],
    varying: VaryingPlaces | None,
    key: str,
    where: tuple[int, int],
) -> set[int]:
    """:func:`_varied_learned` on the text's facts."""
    if varying is None or not learned:
        return set(learned)
    moving: set[int] = set()
    for ordinal, (first, last) in enumerate(tm.runs(facts, sorted(learned), bridge_blank=True)):
        run = text[facts.start(first) : facts.start(last + 1) - 1]
        if varying.observe(key, (*where, "learned", ordinal), run):
            moving.update(range(first, last + 1))
    return moving


def _split_forced_facts(text: str, facts: TextFacts, forced: Counter[int]) -> _Split:
    """:func:`_split_forced` on the text's facts."""
    moving = facts.cached(
        ("forced", frozenset(forced.items())), lambda: whole_units(text, _forced_lines(facts, forced))
    )
    if not moving:
        return _Split(text)
    planned, _, ids = _planned(facts, moving)
    stable, moved = tm.cut(facts, text, planned)
    return _Split(stable, moved, candidates=len(tm.bridge_blanks(facts, moving)), lines=[(0, line) for line in ids])


def _forced_lines(facts: TextFacts, forced: Counter[int]) -> frozenset[int]:
    moving: set[int] = set()
    ambiguous: list[tuple[int, list[int]]] = []
    for hashed, count in forced.items():
        found = facts.line_positions(hashed)
        if not found:
            continue
        if len(found) <= count:
            moving.update(found)
        else:
            ambiguous.append((count, found))
    anchors = sorted(moving)
    for count, found in ambiguous:
        nearest = sorted(found, key=lambda i: (min((abs(i - a) for a in anchors), default=0), i))
        moving.update(nearest[:count])
    return frozenset(moving)


def _split_forced(text: str, lines: list[str], forced: Counter[int]) -> _Split:
    """Move the lines with these hashes, as often as each was moved: of a line the text holds more
    often (a fence, a ``---``), the occurrences nearest the lines only the block holds."""
    where: dict[int, list[int]] = {}
    for i, line in enumerate(lines):
        if line.strip():
            hashed = line_hash(line)
            if hashed in forced:
                where.setdefault(hashed, []).append(i)
    moving: set[int] = set()
    ambiguous: list[tuple[int, list[int]]] = []
    for hashed, found in where.items():
        if len(found) <= forced[hashed]:
            moving.update(found)
        else:
            ambiguous.append((forced[hashed], found))
    anchors = sorted(moving)
    for count, found in ambiguous:
        nearest = sorted(found, key=lambda i: (min((abs(i - a) for a in anchors), default=0), i))
        moving.update(nearest[:count])
    moving = bridge_blanks(lines, set(whole_units(text, moving)))
    if not moving:
        return _Split(text)
    stable, moved = partition_lines(lines, moving)
    return _Split(stable, moved, candidates=len(moving), lines=_line_ids(lines, moving, 0))


def _split_parts(
    parts: list[dict[str, Any]],
    placement: Placement,
    memories: Memories,
    key: str,
    index: int,
    forced: dict[int, Counter[int]] | None,
) -> _Split:
    """Content given as text parts (``[{"type": "text", "text": ...}]``): each part is split like a
    string; parts keep their order, a part left empty is dropped, and the moved lines of all parts
    form one block, joined as the lines of one text are (so a second pass changes nothing)."""
    kept: list[Any] = []
    out = _Split(kept)
    moved: list[str] = []
    moved_parts: list[int] = []
    for number, part in enumerate(parts):
        where = (index, number)
        split = _split_text(part["text"], placement, memories, f"{key}\x00{number}", where, _forced(forced, number))
        out.learned += split.learned
        out.candidates += split.candidates
        out.candidate_finders.extend(split.candidate_finders)  # tagged with their part already
        if not split.moved:
            kept.append(part)
            continue
        moved_parts.append(number)
        out.at_end = split.at_end
        moved.append(split.moved)
        out.spans.extend(split.spans)
        out.lines.extend((number, line) for _, line in split.lines)
        if split.stable:
            kept.append({**part, "text": split.stable})
    # Already behind the stable part: only the last part moves, and within it only its tail.
    out.at_end = out.at_end and moved_parts == [len(parts) - 1]
    out.moved = "\n".join(moved)  # as partition_lines joins the moved lines of one text
    return out


def _line_ids(lines: list[str], moving: set[int], part: int) -> list[tuple[int, int]]:
    return [(part, line_hash(lines[i])) for i in sorted(moving) if lines[i].strip()]


def _with_their_units(text: str, detected: Set[int]) -> frozenset[int]:
    """The detected lines with the whole units they belong to, as the places around them are read:
    a label whose value was not detected on one request (``Git status:`` then ``clean``) and was on
    the next (status lines) is the same place's text both times, and does not make the places around
    it look new."""
    return frozenset(whole_units(text, detected)) if detected else frozenset()


def _skeleton(lines: list[str], detected: Set[int], learned: Set[int]) -> int:
    """The text around the candidates, each run of candidate lines standing as one mark of its kind
    (blank lines left out: a question with paragraphs is one run)."""
    digest = xxhash.xxh3_64()
    previous = b""
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        mark = b"\x00d" if index in detected else b"\x00l" if index in learned else b""
        if mark and mark == previous:
            continue
        digest.update(mark or line.encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
        previous = mark
    return digest.intdigest()


def _varied_learned(
    lines: list[str], learned: set[int], varying: VaryingPlaces | None, key: str, where: tuple[int, int]
) -> set[int]:
    """The learned lines whose run's place has been seen with other text (all of them, without a memory).

    Learned volatility knows the lines differ from the app's other prompts; an app built on the same
    text (another header over a shared instruction) looks the same to it at first. The place's own
    history tells the two apart."""
    if varying is None or not learned:
        return learned
    moving: set[int] = set()
    for ordinal, (first, last) in enumerate(runs(lines, sorted(learned), bridge_blank=True)):
        run = "\n".join(lines[first : last + 1])
        if varying.observe(key, (*where, "learned", ordinal), run):
            moving.update(range(first, last + 1))
    return moving


def _varied_spans(
    text: str, spans: list[Span], varying: VaryingPlaces | None, key: str, where: tuple[int, int]
) -> list[Span]:
    """The spans whose place has been seen with another value (all of them, without a memory)."""
    if varying is None:
        return spans
    ordinals: dict[str, int] = {}
    varied = []
    for span in spans:
        ordinal = ordinals[span.kind] = ordinals.get(span.kind, -1) + 1
        # A kind that varies by nature (an agent's environment) moves at first sight: moving it only
        # once it changed could not help the turn where it first changes.
        value = text[span.start : span.end]
        if span.kind in FIRST_SIGHT_KINDS or varying.observe(key, (*where, span.kind, ordinal), value):
            varied.append(span)
    return varied


def _without(lines: list[str], excluded: set[int]) -> list[str]:
    return [line for i, line in enumerate(lines) if i not in excluded]


def _reindex(lines: list[str], excluded: set[int], learned: set[int]) -> set[int]:
    """Map indices into the reduced line list back to indices into ``lines``."""
    kept = [i for i in range(len(lines)) if i not in excluded]
    return {kept[i] for i in learned}


# -- placing what moves -------------------------------------------------------------------------


def _move_to_system_end(messages: list[dict[str, Any]], splits: list[_Split | None]) -> tuple[list[Action], str]:
    actions: list[Action] = []
    system_tail = ""
    for index, split in enumerate(splits):
        if split is None or not split.moved or split.at_end:
            continue  # at_end: already behind the stable part, nothing to move
        messages[index] = {**messages[index], "content": _append_text(split.stable, split.moved)}
        actions.extend(_span_actions(split.spans))
        actions.append(Action("volatile_moved", "system_end"))
        if index == len(splits) - 1 and split.stable:
            system_tail = split.moved
    return actions, system_tail


def _append_text(stable: str | list[Any], moved: str) -> str | list[Any]:
    if isinstance(stable, list):
        return [*stable, {"type": "text", "text": moved}]
    return f"{stable}\n\n{moved}" if stable else moved


@dataclass
class _Inserted:
    actions: list[Action]
    stable_count: int
    # Where the block is (None: restated questions were inserted too).
    inserted: tuple[int, ...] | None = ()


def _insert(
    messages: list[dict[str, Any]],
    splits: Sequence[_Split | None],
    position: int,
    placement: Placement,
    layout: _Layout | None,
    *,
    fresh: bool,
    target: str | None = None,
) -> _Inserted:
    """Take the moved lines out of the system messages and insert them as one system message at
    ``position`` (an index into ``messages`` as the client sent them); ``target`` names a fresh
    position (the configured one unless said otherwise)."""
    system_count = len(splits)
    actions: list[Action] = []
    moved_blocks: list[str] = []
    emptied: list[int] = []
    for index, split in enumerate(splits):
        if split is None or not split.moved:
            continue
        if not split.stable and index == system_count - 1 and position == system_count:
            # A wholly volatile last system message right before its insertion point is already in place.
            continue
        actions.extend(_span_actions(split.spans))
        moved_blocks.append(split.moved)
        if split.stable:
            messages[index] = {**messages[index], "content": split.stable}
        else:
            emptied.append(index)
    if not moved_blocks:
        if layout is not None:
            layout.record_forwarded(messages)
        return _Inserted(actions, system_count - 1)
    if layout is not None:
        layout.record_block(messages, system_count, position, _moved_lines(splits))
    for index in reversed(emptied):
        del messages[index]
    stable_count = system_count - len(emptied)
    block = "\n\n".join(moved_blocks)
    position -= len(emptied)
    messages.insert(position, {"role": "system", "content": block})
    inserted: tuple[int, ...] | None = (position,)
    target = target or placement.target
    actions.append(Action("volatile_moved", target if fresh else "restored"))
    detected = any(split is not None and split.spans for split in splits)
    if fresh and target == "before_last_user" and placement.restore_query_blocks and not detected:
        # Only learned lines: detected spans (dates, retrieved context) are not a restatement.
        count = restore_query_blocks(messages, block, stable_count, _last_user_index(messages))
        if count:
            actions.append(Action("query_blocks_restored", str(count)))
            inserted = None
    if layout is not None:
        layout.record_forwarded(messages, stable_count)
    return _Inserted(actions, stable_count, inserted)


def _system_lines(messages: list[dict[str, Any]]) -> set[MovedLine]:
    """(message index, text part, line hash) of every non-blank line of these system messages."""
    lines: set[MovedLine] = set()
    for index, message in enumerate(messages):
        for part, text in enumerate(_texts(message.get("content"))):
            lines.update((index, part, line_hash(line)) for line in split_lines(text) if line.strip())
    return lines


class _SystemLines:
    """Whether the system messages hold a block's lines (``_system_lines(messages).issuperset(block)``),
    asked for each block remembered at a position (up to ``BLOCKS_PER_POSITION``, most of them
    differing in one line): each text part's facts are found once, the lines looked up in them."""

    def __init__(self, messages: list[dict[str, Any]], texts: TextScope | None) -> None:
        self._messages = messages
        self._texts = texts
        # Per (message, text part): whether its text holds a line hash (None: no such text).
        self._holders: dict[tuple[int, int], Callable[[int], bool] | None] = {}
        self._lines: set[MovedLine] | None = None

    def hold(self, block: Block) -> bool:
        if self._texts is None:
            if self._lines is None:
                self._lines = _system_lines(self._messages)
            return self._lines.issuperset(block)
        holders = self._holders
        for index, part, line in block:
            place = (index, part)
            holder = holders[place] if place in holders else holders.setdefault(place, self._holder(index, part))
            if holder is None or not holder(line):
                return False
        return True

    def _holder(self, index: int, part: int) -> Callable[[int], bool] | None:
        if index >= len(self._messages) or self._texts is None:
            return None
        found = _texts(self._messages[index].get("content"))
        return self._texts.facts(found[part], "").holder() if part < len(found) else None


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if is_text_parts(content):
        return [part["text"] for part in content]
    return []


def _moved_lines(splits: Sequence[_Split | None]) -> Block:
    return tuple(
        (index, part, line) for index, split in enumerate(splits) if split is not None for part, line in split.lines
    )


def _fresh_position(
    messages: list[dict[str, Any]], system_count: int, placement: Placement, layout: _Layout | None
) -> tuple[int, str]:
    """Where moved lines go when nothing was forwarded with them before, and that place's name."""
    last_user = _last_user_index(messages)
    if last_user < len(messages):
        if placement.target == "after_last_user":
            return last_user + 1, "after_last_user"
        if layout is not None and last_user == system_count == len(messages) - 1 and layout.templated(messages[-1]):
            # A one-shot request whose question opens as an earlier one of the app did: the user turn
            # is a template (a task instruction around data: a chat's title or follow-up task, a
            # workflow's LLM node). Before it, lines that change would cost every such request the
            # whole template; after it, they cost only themselves.
            return last_user + 1, "after_templated_user"
    return last_user, placement.target


def _span_actions(spans: Iterable[Span]) -> list[Action]:
    counts: dict[str, int] = {}
    for span in spans:
        counts[span.kind] = counts.get(span.kind, 0) + 1
    return [Action(f"volatile_{kind}", str(n)) for kind, n in sorted(counts.items())]


def _has_user_after(messages: list[dict[str, Any]], start: int) -> bool:
    return any(m.get("role") == "user" for m in islice(messages, start, None))


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return len(messages)


# -- the conversation's memory ------------------------------------------------------------------


class _Layout:
    """One request's view of the forwarded-layout memory (chains of message digests).

    Two kinds of chain: a prompt's, over its leading system messages (what ``continues`` and
    ``record_forwarded`` read: a prompt forwarded is remembered by them, so a request continues
    one exactly when it continues its system messages), and the history's, over the messages after
    them, whose links name the positions where blocks were inserted. The history is the same on
    every request of a conversation but for what it adds: its digests and chain are taken from the
    conversation's last request (``ForwardedLayouts.digested``) and only the messages it adds are
    serialized, hashed and chained."""

    def __init__(self, layouts: ForwardedLayouts, header: int, app_key: str) -> None:
        self._layouts = layouts
        self._header = header
        self._app = xxhash.xxh3_64_intdigest(app_key.encode("utf-8", "surrogatepass"))
        # The few system messages a request chains again (as sent, split, with a block): each
        # serialized and hashed once.
        self._digests: dict[int, tuple[Any, int]] = {}
        # The request's history as it came (the messages after its leading system messages), its
        # digests and its chain (``chain[k]``: the header and the first ``k``), where its own
        # system messages are, and where blocks had been inserted in it (offsets: the position
        # before history message ``k`` is named by ``chain[k + 1]``) as of ``mark`` blocks written.
        self._history: list[Any] = []
        self._system_count = 0
        self._history_digests: array[int] = array("Q")
        self._history_chain: array[int] = array("Q", [header])
        self._history_systems: list[int] = []
        self._blocks: list[int] = []
        self._mark = 0
        self._resumed: Resumption[Digested] | None = None
        # Restorations' memory (``Digested.line_offsets``, ``system_texts``, ``held``), carried
        # from the conversation's last request; ``_fresh``: the offsets whose blocks it did not
        # know (None: nothing carried, every block is looked at).
        self._line_offsets: dict[MovedLine, frozenset[int]] = {}
        self._system_texts: dict[tuple[int, int], tuple[str, frozenset[int]]] | None = None
        self._held: frozenset[int] = frozenset()
        self._fresh: set[int] | None = None

    def resume(self, namespace: str, messages: list[dict[str, Any]]) -> None:
        """Digest and chain the request's history, taking what its conversation's last request
        shares with it (under another header, its digests only); and where blocks had been inserted
        in it: those the last request knew of, those written since (a few), and those before the
        messages it adds."""
        self._system_count = system_count = leading_system_count(messages)
        self._history = history = messages[system_count:]
        self._resumed = resumed = self._layouts.digested.resume(namespace, history)
        digests, systems, chain = array("Q"), [], array("Q", [self._header])
        blocks: list[int] | None = None
        rewritten: list[int] = []
        state, shared = resumed.state, resumed.shared
        if state is not None and shared:
            digests = state.digests[:shared]
            systems = state.systems[: bisect_left(state.systems, shared)]
            if state.header == self._header:
                chain = state.chain[: shared + 1]
                since = self._layouts.written_since(state.mark)
                if since is not None:
                    blocks = state.blocks[: bisect_left(state.blocks, shared)]
                    rewritten = self._offsets(chain, since, shared)
                    blocks += rewritten
        for offset in range(len(digests), len(history)):
            message = history[offset]
            if isinstance(message, dict) and message.get("role") == "system":
                systems.append(offset)
        digests.extend(map(message_digest, history[len(digests) :]))
        self._history_digests, self._history_systems = digests, systems
        self._history_chain = chain = extend_links(chain, digests[len(chain) - 1 :])
        known = 0 if blocks is None else shared
        added = self._layouts.with_blocks(chain[1:], known)
        self._blocks = sorted({*(blocks or ()), *added})
        self._mark = self._layouts.written
        if blocks is not None and state is not None:
            # Carried: index only the blocks it did not know (a few: those this turn adds).
            self._fresh = {*rewritten, *added}
            self._line_offsets = state.line_offsets
            self._system_texts, self._held = state.system_texts, state.held
        else:
            self._fresh, self._line_offsets = None, {}
        self._index_blocks(chain, self._blocks if self._fresh is None else sorted(self._fresh))

    def _index_blocks(self, chain: Sequence[int], offsets: Iterable[int]) -> None:
        """Add the lines of the blocks at these history offsets to ``_line_offsets`` (a copy: the
        carried one is the last request's, which a lane of the conversation may resume too)."""
        index: dict[MovedLine, set[int]] = {}
        for offset in offsets:
            for block in self._layouts.blocks_at(chain[offset + 1]):
                for line in block:
                    index.setdefault(line, set()).add(offset)
        if index:
            merged = dict(self._line_offsets)
            for line, found in index.items():
                merged[line] = merged.get(line, frozenset()) | found
            self._line_offsets = merged

    @staticmethod
    def _offsets(chain: array[int], positions: list[int], below: int) -> list[int]:
        """The history offsets (below ``below``) of these block positions, where the chain names them."""
        found = []
        for position in set(positions):
            try:
                index = chain.index(position, 1, below + 1)  # a pass over the array's memory, in C
            except ValueError:
                continue
            found.append(index - 1)
        return found

    def history_systems(self) -> list[Any]:
        """The system messages of the request's history (after its leading ones), as sent."""
        return [self._history[offset] for offset in self._history_systems]

    def keep(self) -> None:
        """Keep the history's digests, chain and blocks (with those this request wrote) for the
        conversation's next request."""
        if self._resumed is None:
            return
        chain = self._history_chain
        since = self._layouts.written_since(self._mark)
        blocks, held = self._blocks, self._held
        if since:
            # Blocks written since the request began (by this request): the next one knows their
            # lines and looks at them (they are where its unchanged lines go again).
            written = self._offsets(chain, since, len(chain) - 1)
            blocks = sorted({*blocks, *written})
            self._index_blocks(chain, written)
            held = held.union(written)
        mark = self._layouts.written if since is not None else _UNKNOWN_MARK
        digested = Digested(
            self._history_digests,
            self._header,
            chain,
            self._history_systems,
            blocks,
            mark,
            self._line_offsets,
            self._system_texts,
            held,
        )
        self._resumed.keep(self._history, digested)

    def _digest(self, message: Any) -> int:
        known = self._digests.get(id(message))
        if known is not None and known[0] is message:
            return known[1]
        digest = message_digest(message)
        self._digests[id(message)] = (message, digest)
        return digest

    def _prompt_chain(self, messages: list[dict[str, Any]], upto: int) -> list[int]:
        """``chain[k]`` for ``k <= upto``: the header and ``messages[:k]`` (a few system messages)."""
        return extend_links([self._header], [self._digest(m) for m in messages[:upto]])

    def _is_history(self, messages: list[dict[str, Any]], system_count: int) -> bool:
        """Whether ``messages[system_count:]`` is the request's history as it came (the callers
        pass the request's messages, their system messages split, before a block is inserted)."""
        history = self._history
        if system_count != self._system_count or len(messages) - system_count != len(history):
            return False
        return not history or (messages[system_count] is history[0] and messages[-1] is history[-1])

    def _history_links(self, messages: list[dict[str, Any]], system_count: int) -> Sequence[int]:
        """The chain over ``messages[system_count:]``: the request's history's, or chained here."""
        if self._is_history(messages, system_count):
            return self._history_chain
        return extend_links([self._header], [self._digest(m) for m in messages[system_count:]])

    def _block_offsets(self, messages: list[dict[str, Any]], system_count: int) -> tuple[Sequence[int], list[int]]:
        """The history's block positions (its chain after the header) and the offsets among them
        where blocks were inserted."""
        positions = self._history_links(messages, system_count)[1:]
        if self._is_history(messages, system_count):
            return positions, self._blocks
        return positions, self._layouts.with_blocks(positions)

    def app_had_blocks(self) -> bool:
        return self._layouts.app_had_blocks(self._app)

    def templated(self, message: dict[str, Any]) -> bool:
        """Whether the message opens (its first TEMPLATE_OPENING_CHARS, with more after them) the way
        a message this app sent in this place before did; remembers the opening either way."""
        texts = _texts(message.get("content"))
        if not texts or len(texts[0]) <= TEMPLATE_OPENING_CHARS:
            return False
        opening = texts[0][:TEMPLATE_OPENING_CHARS].encode("utf-8", "surrogatepass")
        return self._layouts.remember_opening(xxhash.xxh3_64_intdigest(opening, seed=self._app))

    def continues(self, messages: list[dict[str, Any]], system_count: int) -> bool:
        """Whether the request, as laid out, extends a prompt forwarded before at least as far as its
        system messages: an earlier turn of this conversation went out this way, or another request
        of the app sent this very system prompt (its lines did not differ from what was sent there).

        A prompt forwarded is remembered with its leading system messages on their own (and those
        at least as recently: ``record_forwarded``), so a request extends one exactly when one of
        its prefixes from ``system_count`` messages to its leading system messages is remembered:
        only those few are looked up (the longest first), not its whole history."""
        top = min(leading_system_count(messages), len(messages) - 1)
        if top < system_count:
            return False
        chain = self._prompt_chain(messages, top)
        return any(self._layouts.knows_prompt(chain[k]) for k in range(top, system_count - 1, -1))

    def restorations(
        self, messages: list[dict[str, Any]], system_count: int, placement: Placement, memories: Memories
    ) -> Iterator[tuple[int, list[_Split | None]]]:
        """Where blocks were inserted in this conversation before, each with the same lines split out
        again (earliest position first; blocks whose lines are not all in the system prompt skipped)."""
        # The position before history message ``offset`` is named by the link after it.
        positions, offsets = self._block_offsets(messages, system_count)
        present = _SystemLines(messages[:system_count], memories.texts)
        looked_at, tracked = self._maybe_held(messages, system_count, offsets, memories.texts)
        found: list[tuple[int, Block]] = []
        for offset in looked_at:
            held = [block for block in self._layouts.blocks_at(positions[offset]) if present.hold(block)]
            found.extend((offset, block) for block in held)
        if tracked:
            self._held = frozenset(offset for offset, _ in found)
        for offset, block in found:
            yield system_count + offset, self.split_again(messages, system_count, block, placement, memories)

    def _maybe_held(
        self, messages: list[dict[str, Any]], system_count: int, offsets: list[int], texts: TextScope | None
    ) -> tuple[list[int], bool]:
        """The offsets (of ``offsets``, in order) whose blocks this request's system messages may
        hold, and whether what is found held is to be remembered (``_held``): those held by the
        request the carried memory was taken at (and blocks it wrote), those it did not know, and
        those with a line new in the system texts since. Exact: a block whose every line is held
        now and was not then has a line that was not there then. ``offsets`` itself where nothing
        is carried (each block is looked at, and the memory starts here)."""
        if texts is None or not self._is_history(messages, system_count):
            return offsets, False
        before, fresh = self._system_texts, self._fresh
        line_offsets = self._line_offsets
        maybe: set[int] = {*self._held, *(fresh or ())}
        now: dict[tuple[int, int], tuple[str, frozenset[int]]] = {}
        for index in range(system_count):
            for part, text in enumerate(_texts(messages[index].get("content"))):
                was = before.get((index, part)) if before is not None else None
                if was is not None and (was[0] is text or was[0] == text):
                    now[(index, part)] = was
                    continue
                lines = texts.facts(text, "").hash_set()
                now[(index, part)] = (text, lines)
                if before is not None and fresh is not None:
                    for line in lines if was is None else lines - was[1]:
                        maybe.update(line_offsets.get((index, part, line), ()))
        self._system_texts = now
        if before is None or fresh is None:
            return offsets, True
        return sorted(maybe.intersection(offsets)), True

    def forwarded_conversation(self, messages: list[dict[str, Any]], stable_count: int) -> bool:
        """Whether this conversation (its first user turn) was forwarded before right after these
        stable system messages, blocks inserted between them aside (the same app, model and tools)."""
        key = self._conversation_key(messages, stable_count)
        return key is not None and self._layouts.knows_prompt(key)

    def _conversation_key(self, messages: list[dict[str, Any]], stable_count: int) -> int | None:
        first_user = next((m for m in islice(messages, stable_count, None) if m.get("role") == "user"), None)
        if first_user is None:
            return None
        chain = self._prompt_chain(messages, stable_count)[-1]
        # Marked: a key of its own, never taken for the forwarded prompt [system, first user].
        return extend(extend(chain, self._digest(first_user)), _CONVERSATION_MARK)

    def had_blocks(self, messages: list[dict[str, Any]], system_count: int) -> bool:
        """Whether a block was inserted anywhere in this conversation's history before (its lines
        since changed, or :meth:`restorations` would have put them back): it is not new here."""
        positions, offsets = self._block_offsets(messages, system_count)
        return any(self._layouts.blocks_at(positions[offset]) for offset in offsets)

    @staticmethod
    def split_again(
        messages: list[dict[str, Any]], system_count: int, block: Block, placement: Placement, memories: Memories
    ) -> list[_Split | None]:
        forced: dict[int, dict[int, Counter[int]]] = {}
        for index, part, line in block:
            forced.setdefault(index, {}).setdefault(part, Counter())[line] += 1
        return [
            _split_message(messages[index], placement, memories, "", index, forced.get(index, {}))
            for index in range(system_count)
        ]

    def record_block(self, messages: list[dict[str, Any]], system_count: int, position: int, lines: Block) -> None:
        """Remember ``lines`` inserted before ``messages[position]`` (the client's layout)."""
        if position >= len(messages):
            return
        history = self._history_links(messages, system_count)
        self._layouts.remember_block(history[position - system_count + 1], lines, self._app)

    def record_forwarded(self, messages: list[dict[str, Any]], stable_count: int | None = None) -> None:
        """Remember the forwarded prompt by its leading system messages (what ``continues`` reads)
        and (with the stable system messages ahead of any block inserted before the first user turn)
        which conversation went out after them."""
        system_count = leading_system_count(messages)
        self._layouts.remember_prompt(self._prompt_chain(messages, system_count)[system_count])
        key = self._conversation_key(messages, system_count if stable_count is None else stable_count)
        if key is not None:
            self._layouts.remember_prompt(key)
