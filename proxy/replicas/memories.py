"""The canonicalizer's memories, journaling what they learn and applying what other replicas learned.

Each memory keeps its in-process behaviour exactly (the canon engine cannot tell the difference);
a subclass records every change worth sharing as a small entry (hashes, ids and, for tool calls,
the argument bytes the backend generated: never prompt text), and applies entries from other
replicas through the base class, without journaling them again. What each entry means:

- ``L`` a system prompt's line hashes, observed for an app (learned volatility);
- ``V`` a value's hash seen at a place (the place varies once two differ);
- ``P`` a forwarded prompt's chain hash; ``B`` a block of moved lines inserted at a position;
- ``T`` a tool call the backend generated (or first sent), by position key;
- ``O`` the reference form of an app's tools (the first seen, which reorderings are given back as);
- ``S`` a model whose chat template refuses a second system message (1), or not (0).

Only changes are journaled: a prompt, place value or block already known is not sent again, so a
steady workload writes little.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

from proxy.canon import (
    _VARIED,
    Block,
    Canonicalizer,
    ForwardedLayouts,
    GeneratedCall,
    LearnedVolatility,
    Place,
    PromptLines,
    ToolCallMemory,
    ToolOrders,
    VaryingPlaces,
)
from proxy.config import CanonSettings
from proxy.recent import RecentSet

Entry = list[Any]

# Larger tool-call arguments stay local: one entry must not weigh on every replica's memory.
MAX_SHARED_ARGUMENT_BYTES = 64 * 1024
# Tool definitions are shared up to this size (a coding agent's run to about 100 KB, once per app).
MAX_SHARED_TOOLS_BYTES = 256 * 1024


class Journal:
    """Entries learned since the last flush; ``on_entry`` is told (to schedule the write-behind)."""

    def __init__(self, on_entry: Callable[[], None] | None = None) -> None:
        self.entries: list[Entry] = []
        self.on_entry = on_entry

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        if self.on_entry is not None:
            self.on_entry()

    def drain(self) -> list[Entry]:
        entries, self.entries = self.entries, []
        return entries


class SharedLearnedVolatility(LearnedVolatility):
    def __init__(self, journal: Journal, max_apps: int, history: int) -> None:
        super().__init__(max_apps, history)
        self._journal = journal
        # (app, prompt) already shared: a prompt the app sends again adds nothing another replica needs.
        self._shared: RecentSet[tuple[str, int]] = RecentSet(16_384)

    def observe_lines(self, app_key: str, prompt: PromptLines) -> set[int]:
        volatile = super().observe_lines(app_key, prompt)
        if not self._shared.add((app_key, prompt.hashes_digest)):
            self._journal.add(["L", app_key, list(prompt.hashes)])
        return volatile

    def apply(self, app_key: str, hashes: list[int]) -> None:
        prompt = PromptLines(hashes)
        self._shared.add((app_key, prompt.hashes_digest))
        super().observe_lines(app_key, prompt)


class SharedVaryingPlaces(VaryingPlaces):
    def __init__(self, journal: Journal, max_apps: int) -> None:
        super().__init__(max_apps)
        self._journal = journal

    def observe_digest(self, app_key: str, place: Place, digest: int) -> bool:
        places = self._apps.get(app_key)
        before = places.get(place) if places is not None else None
        varied = super().observe_digest(app_key, place, digest)
        if before != _VARIED and before != digest:
            self._journal.add(["V", app_key, list(place), digest])
        return varied

    def apply(self, app_key: str, place: Place, digest: int) -> None:
        super().observe_digest(app_key, place, digest)


class SharedLayouts(ForwardedLayouts):
    def __init__(self, journal: Journal, max_entries: int) -> None:
        super().__init__(max_entries)
        self._journal = journal

    def remember_prompt(self, key: int) -> None:
        if not self.knows_prompt(key):
            self._journal.add(["P", key])
        super().remember_prompt(key)

    def remember_block(self, position: int, block: Block, app: int) -> None:
        if self.blocks_at(position)[:1] != (block,):
            self._journal.add(["B", position, [list(line) for line in block], app])
        super().remember_block(position, block, app)

    def remember_opening(self, key: int) -> bool:
        seen = super().remember_opening(key)
        if not seen:
            self._journal.add(["U", key])
        return seen

    def apply_prompt(self, key: int) -> None:
        super().remember_prompt(key)

    def apply_opening(self, key: int) -> None:
        super().remember_opening(key)

    def apply_block(self, position: int, block: Block, app: int) -> None:
        super().remember_block(position, block, app)


class SharedToolOrders(ToolOrders):
    """Every replica gives an app's reordered tools back as the same reference form. Two replicas
    that saw different first forms at once settle on the one whose hash is smaller."""

    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self._journal = journal

    def store(self, key: int, sent: int, canonical: int, raw: bytes) -> None:
        super().store(key, sent, canonical, raw)
        if len(raw) <= MAX_SHARED_TOOLS_BYTES:
            self._journal.add(["O", key, sent, canonical, raw.decode("utf-8", "surrogatepass")])

    def apply(self, key: int, sent: int, canonical: int, raw: bytes) -> None:
        known = self.known(key)
        if known is None or known[1] != canonical or sent < known[0]:
            super().store(key, sent, canonical, raw)


class SharedToolCalls(ToolCallMemory):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self._journal = journal

    def remember(self, key: int, call: GeneratedCall, generated_for: str | None = None) -> None:
        if self.recall(key) != call and len(call.arguments) <= MAX_SHARED_ARGUMENT_BYTES:
            entry: list[Any] = ["T", key, call.id, call.arguments]
            self._journal.add([*entry, generated_for] if generated_for is not None else entry)
        super().remember(key, call, generated_for)

    def apply(self, key: int, call: GeneratedCall, generated_for: str | None = None) -> None:
        super().remember(key, call, generated_for)


class SharedCanonicalizer(Canonicalizer):
    """A :class:`Canonicalizer` whose memories journal into ``journal`` and apply others' entries."""

    def __init__(self, settings: CanonSettings, journal: Journal) -> None:
        super().__init__(settings)
        self.journal = journal
        if self.learned is not None:
            self.learned = SharedLearnedVolatility(journal, settings.learned_apps_max, settings.learned_history)
        if self.varying is not None:
            self.varying = SharedVaryingPlaces(journal, max(settings.learned_apps_max, 1))
        if self.layouts is not None:
            self.layouts = SharedLayouts(journal, settings.layout_memory_entries)
        self.tool_memory = SharedToolCalls(journal)
        self.tool_orders = SharedToolOrders(journal)

    def keep_structure(self, model: str | None) -> None:
        if not self.keeps_structure(model):
            self.journal.add(["S", str(model), 1])
        super().keep_structure(model)

    def forget_structure(self, model: str | None) -> None:
        if self.keeps_structure(model):
            self.journal.add(["S", str(model), 0])
        super().forget_structure(model)

    def apply_entries(self, entries: list[Entry]) -> int:
        """Apply what another replica learned; returns how many entries were understood.

        Malformed entries are skipped: a replica of another version must not stop this one.
        """
        applied = 0
        for entry in entries:
            try:
                applied += self._apply(entry)
            except (TypeError, ValueError, IndexError, KeyError):
                continue
        return applied

    def _apply(self, entry: Entry) -> int:
        kind = entry[0]
        if kind == "L" and isinstance(self.learned, SharedLearnedVolatility):
            self.learned.apply(str(entry[1]), [int(h) for h in entry[2]])
        elif kind == "V" and isinstance(self.varying, SharedVaryingPlaces):
            message, part, detector, ordinal = entry[2]
            self.varying.apply(str(entry[1]), (int(message), int(part), str(detector), int(ordinal)), int(entry[3]))
        elif kind == "P" and isinstance(self.layouts, SharedLayouts):
            self.layouts.apply_prompt(int(entry[1]))
        elif kind == "U" and isinstance(self.layouts, SharedLayouts):
            self.layouts.apply_opening(int(entry[1]))
        elif kind == "B" and isinstance(self.layouts, SharedLayouts):
            block = tuple((int(m), int(p), int(h)) for m, p, h in entry[2])
            self.layouts.apply_block(int(entry[1]), block, int(entry[3]))
        elif kind == "T" and isinstance(self.tool_memory, SharedToolCalls):
            generated_for = str(entry[4]) if len(entry) > 4 and entry[4] is not None else None
            call = GeneratedCall(id=str(entry[2]), arguments=str(entry[3]))
            self.tool_memory.apply(int(entry[1]), call, generated_for)
        elif kind == "O" and isinstance(self.tool_orders, SharedToolOrders):
            raw = str(entry[4]).encode("utf-8", "surrogatepass")
            if xxhash.xxh3_64_intdigest(raw) != int(entry[2]):
                raise ValueError("tool reference does not match its hash")
            self.tool_orders.apply(int(entry[1]), int(entry[2]), int(entry[3]), raw)
        elif kind == "S":
            if entry[2]:
                Canonicalizer.keep_structure(self, entry[1])
            else:
                Canonicalizer.forget_structure(self, entry[1])
        else:
            return 0
        return 1
