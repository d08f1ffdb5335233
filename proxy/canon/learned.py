"""Learned volatility: regions of a system prompt that have been seen to vary.

Fixed detectors cannot know every template: Dify inlines ``{{#sys.query#}}``,
upstream node outputs or a persona variable anywhere in a system prompt. Requests
of one app (same tenant and model, and a system prompt that shares most of its
lines with the app's recent ones: a *template*) are compared line by line, in
order: the prompt is aligned against each of the template's recent prompts
(``difflib.SequenceMatcher`` on line hashes, common head and tail trimmed first),
and a line that is not aligned with a line of every one of them has been seen to
vary. Alignment, not set lookup: a ````` fence or a ``---`` that also occurs in the
stable text is not taken for stable text when it sits among lines that vary (the
caller widens such regions over lines too weak to anchor, see ``relocation``).
Only 64-bit line hashes are kept, never text.

Memory is bounded (``max_apps`` keys x ``templates_per_app`` templates, each
remembering ``history`` prompts) and the outcome depends only on the sequence of
requests seen: deterministic.

A prompt the app sent before costs no work per line: its sequence, digest and line set come
prepared (:class:`PromptLines`, which the caller can keep with the text), the template it matched
is remembered until a template of the app changes, and a template's stable core is recomputed
only when its recent prompts change (not when one of them is sent again).
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from itertools import compress

import xxhash
from cachetools import LRUCache

MIN_MATCH = 0.6
# Alignments a template remembers (pairs of its recent prompts).
MAX_PAIRS_REMEMBERED = 16
# A template seen once: the share of the larger of the two prompts they must have in common.
FIRST_MATCH = 0.3
# The share of an incoming prompt's lines a template's core must hold to take it in.
MIN_SHARE = 0.25

Sequence_ = tuple[int, ...]


def line_hash(line: str) -> int:
    return xxhash.xxh3_64_intdigest(line.encode("utf-8", "surrogatepass"))


def _packed(hashes: Sequence[int] | array[int]) -> bytes:
    """The hashes as 8-byte little-endian words, one after the other."""
    if sys.byteorder == "little":
        return (hashes if isinstance(hashes, array) else array("Q", hashes)).tobytes()
    return b"".join(h.to_bytes(8, "little") for h in hashes)


def _digest(sequence: Sequence_) -> int:
    return xxhash.xxh3_64_intdigest(_packed(sequence))


class PromptLines:
    """One prompt's line hashes (0 for a blank line), prepared for :meth:`LearnedVolatility.observe_lines`:
    the non-blank lines' positions, their hashes in order and the digest of those. Pure: a caller
    that keeps it with the text observes the same prompt again without touching its lines."""

    __slots__ = ("_members", "_packed_digest", "digest", "hashes", "positions", "sequence")

    def __init__(self, hashes: Sequence[int] | array[int]) -> None:
        self.hashes = hashes
        self.positions = list(compress(range(len(hashes)), hashes))
        self.sequence: Sequence_ = tuple(compress(hashes, hashes))
        self.digest = _digest(self.sequence)
        self._members: frozenset[int] | None = None
        self._packed_digest: int | None = None

    @property
    def members(self) -> frozenset[int]:
        if self._members is None:
            self._members = frozenset(self.sequence)
        return self._members

    @property
    def hashes_digest(self) -> int:
        """The digest of all the hashes, blank lines' zeros included (what replicas key on)."""
        if self._packed_digest is None:
            self._packed_digest = xxhash.xxh3_64_intdigest(_packed(self.hashes))
        return self._packed_digest


@dataclass
class _Template:
    # The non-blank line hashes of the last prompts, in order, with their digests.
    recent: deque[tuple[int, Sequence_]]
    core: frozenset[int] = field(default_factory=frozenset)
    # The last answer: (the prompt's digest, the distinct recent digests it was aligned with, result).
    memo: tuple[int, tuple[int, ...], frozenset[int]] | None = None
    # The line sets of the distinct recent prompts, by digest (the core is their intersection).
    members: dict[int, frozenset[int]] = field(default_factory=dict)
    # What was not aligned between two prompts (by digest, that prompt's positions): a prompt sent
    # again is aligned with the template's others once each.
    pairs: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)

    def add(self, digest: int, sequence: Sequence_, members: frozenset[int] | None = None) -> bool:
        """Remember a prompt; True when the core changed. The core is the intersection of the distinct
        recent prompts' lines, so a prompt sent again (the same distinct prompts) leaves it as it was."""
        self.recent.append((digest, sequence))
        distinct = {d for d, _ in self.recent}
        if distinct == self.members.keys():
            return False
        if digest not in self.members:
            self.members[digest] = members if members is not None else frozenset(sequence)
        for gone in self.members.keys() - distinct:
            del self.members[gone]
        core = frozenset.intersection(*self.members.values())
        changed = core != self.core
        self.core = core
        return changed

    def unaligned(self, digest: int, sequence: Sequence_) -> frozenset[int]:
        """Positions in ``sequence`` not aligned with a line of every recent prompt."""
        distinct: dict[int, Sequence_] = {}
        for known, lines in self.recent:
            distinct.setdefault(known, lines)
        others = tuple(d for d in distinct if d != digest)
        if self.memo is not None and self.memo[:2] == (digest, others):
            return self.memo[2]
        unaligned: set[int] = set()
        for other in others:
            pair = (digest, other)
            found = self.pairs.get(pair)
            if found is None:
                aligned = _aligned(sequence, distinct[other])
                found = frozenset(i for i in range(len(sequence)) if i not in aligned)
                if len(self.pairs) >= MAX_PAIRS_REMEMBERED:
                    self.pairs.clear()
                self.pairs[pair] = found
            unaligned.update(found)
            if len(unaligned) == len(sequence):
                break
        result = frozenset(unaligned)
        self.memo = (digest, others, result)
        return result


def _aligned(current: Sequence_, other: Sequence_) -> set[int]:
    """Positions of ``current`` aligned with a line of ``other`` (order-preserving)."""
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
        matcher = SequenceMatcher(None, middle, known, autojunk=False)
        for start, _, size in matcher.get_matching_blocks():
            aligned.update(range(head + start, head + start + size))
    return aligned


class _App:
    """One app key's templates, most recently matched first, and which template each prompt
    (by digest) matched while none of them changed."""

    __slots__ = ("matched", "templates")

    def __init__(self) -> None:
        self.templates: list[_Template] = []
        self.matched: dict[int, _Template] = {}


MAX_MATCHES_REMEMBERED = 64


class LearnedVolatility:
    # Templates per app key (tenant, model): a tenant's apps on one model share a key.
    def __init__(self, max_apps: int = 1024, history: int = 8, templates_per_app: int = 32) -> None:
        # At least one app (canon.learned_apps_max may be 0, as VaryingPlaces reads it): a cache of
        # none refuses every insertion.
        self._apps: LRUCache[str, _App] = LRUCache(max(1, max_apps))
        self._history = max(2, history)
        self._templates_per_app = templates_per_app

    def observe(self, app_key: str, lines: list[str]) -> set[int]:
        """Record one prompt (as lines) and return the indices of lines seen to vary."""
        return self.observe_hashes(app_key, [line_hash(line) if line.strip() else 0 for line in lines])

    def observe_hashes(self, app_key: str, hashes: list[int]) -> set[int]:
        """:meth:`observe` on the lines' hashes (0 for a blank line): what another replica shares."""
        return self.observe_lines(app_key, PromptLines(hashes))

    def observe_lines(self, app_key: str, prompt: PromptLines) -> set[int]:
        """:meth:`observe_hashes` on a prepared prompt (the same outcome, without work per line for a
        prompt prepared before)."""
        positions = prompt.positions
        if not positions:
            return set()
        sequence, digest = prompt.sequence, prompt.digest
        app = self._apps.get(app_key)  # a use: the app sent a prompt
        if app is None:
            app = self._apps[app_key] = _App()
        templates = app.templates
        # What _match would answer: the templates' cores, order and first sightings are as they were
        # when this prompt matched last (any change to them forgets every remembered match).
        template = app.matched.get(digest)
        if template is None:
            template = self._match(templates, prompt.members)
        changed = False
        if template is None:
            template = _Template(recent=deque(maxlen=self._history))
            templates.insert(0, template)
            del templates[self._templates_per_app :]
            volatile: set[int] = set()
            changed = True
        else:
            volatile = {positions[i] for i in template.unaligned(digest, sequence)}
            if templates[0] is not template:  # least recently matched out, not least recently made
                templates.remove(template)
                templates.insert(0, template)
                changed = True
        first_sighting = len(template.recent) <= 1  # a template seen once is matched on its own terms
        changed |= template.add(digest, sequence, prompt.members) | first_sighting
        if changed or len(app.matched) >= MAX_MATCHES_REMEMBERED:
            app.matched.clear()
        if not changed:
            # Nothing _match reads changed: the prompt matches this template again, until something does.
            app.matched[digest] = template
        return volatile

    @staticmethod
    def _match(templates: list[_Template], current: frozenset[int]) -> _Template | None:
        best: _Template | None = None
        best_score = (0, 0.0)
        for template in templates:
            if not template.core:
                continue
            shared = len(template.core & current)
            # What it shares must be most of its known stable lines (a template seen once knows no
            # stable line yet: then a third of the larger prompt will do) and a good part of this
            # prompt: a core worn down to boilerplate apps share ("answer in the user's language")
            # must not take in every new app.
            settled = shared >= MIN_MATCH * len(template.core)
            if len(template.recent) == 1:
                settled = settled or shared >= FIRST_MATCH * max(len(template.core), len(current))
            if not settled or shared < MIN_SHARE * len(current):
                continue
            score = (shared, shared / len(template.core))
            if score > best_score:
                best, best_score = template, score
        return best

    def __len__(self) -> int:
        return len(self._apps)
