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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from difflib import SequenceMatcher

import xxhash
from cachetools import LRUCache

MIN_MATCH = 0.6
# A template seen once: the share of the larger of the two prompts they must have in common.
FIRST_MATCH = 0.3
# The share of an incoming prompt's lines a template's core must hold to take it in.
MIN_SHARE = 0.25

Sequence_ = tuple[int, ...]


def line_hash(line: str) -> int:
    return xxhash.xxh3_64_intdigest(line.encode("utf-8", "surrogatepass"))


def _digest(sequence: Sequence_) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(h.to_bytes(8, "little") for h in sequence))


@dataclass
class _Template:
    # The non-blank line hashes of the last prompts, in order, with their digests.
    recent: deque[tuple[int, Sequence_]]
    core: frozenset[int] = field(default_factory=frozenset)
    # The last answer: (the prompt's digest, the distinct recent digests it was aligned with, result).
    memo: tuple[int, tuple[int, ...], frozenset[int]] | None = None

    def add(self, digest: int, sequence: Sequence_) -> None:
        self.recent.append((digest, sequence))
        self.core = frozenset.intersection(*(frozenset(s) for _, s in self.recent))

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
            aligned = _aligned(sequence, distinct[other])
            unaligned.update(i for i in range(len(sequence)) if i not in aligned)
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


class LearnedVolatility:
    # Templates per app key (tenant, model): a tenant's apps on one model share a key.
    def __init__(self, max_apps: int = 1024, history: int = 8, templates_per_app: int = 32) -> None:
        self._apps: LRUCache[str, list[_Template]] = LRUCache(max_apps)
        self._history = max(2, history)
        self._templates_per_app = templates_per_app

    def observe(self, app_key: str, lines: list[str]) -> set[int]:
        """Record one prompt (as lines) and return the indices of lines seen to vary."""
        return self.observe_hashes(app_key, [line_hash(line) if line.strip() else 0 for line in lines])

    def observe_hashes(self, app_key: str, hashes: list[int]) -> set[int]:
        """:meth:`observe` on the lines' hashes (0 for a blank line): what another replica shares."""
        positions = [i for i, h in enumerate(hashes) if h]
        if not positions:
            return set()
        sequence = tuple(hashes[i] for i in positions)
        digest = _digest(sequence)
        templates = self._apps.get(app_key)  # a use: the app sent a prompt
        if templates is None:
            templates = self._apps[app_key] = []
        template = self._match(templates, frozenset(sequence))
        if template is None:
            template = _Template(recent=deque(maxlen=self._history))
            templates.insert(0, template)
            del templates[self._templates_per_app :]
            volatile: set[int] = set()
        else:
            volatile = {positions[i] for i in template.unaligned(digest, sequence)}
            if templates[0] is not template:  # least recently matched out, not least recently made
                templates.remove(template)
                templates.insert(0, template)
        template.add(digest, sequence)
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
