"""Learned volatility: spans of a system prompt that have been seen to vary.

Fixed detectors cannot know every template: Dify inlines ``{{#sys.query#}}``,
upstream node outputs or a persona variable anywhere in a system prompt. Requests
of one app (same tenant, model and tools, and a system prompt that shares most
of its lines with the app's recent ones) are compared line by line: a line that
is not present in every one of the app's recent prompts has been seen to vary
and is treated as volatile. Only 64-bit line hashes are kept, never text.

Memory is bounded (``max_apps`` templates, each remembering ``history`` prompts)
and the outcome depends only on the sequence of requests seen: deterministic.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import xxhash

MIN_MATCH = 0.6


def line_hash(line: str) -> int:
    return xxhash.xxh3_64_intdigest(line.encode("utf-8", "surrogatepass"))


@dataclass
class _Template:
    recent: deque[frozenset[int]]
    core: frozenset[int] = field(default_factory=frozenset)

    def add(self, lines: frozenset[int]) -> None:
        self.recent.append(lines)
        self.core = frozenset.intersection(*self.recent)


class LearnedVolatility:
    # Templates per app key (tenant, model, tools): a tenant's chat apps on one model share a key.
    def __init__(self, max_apps: int = 1024, history: int = 8, templates_per_app: int = 32) -> None:
        self._apps: OrderedDict[str, list[_Template]] = OrderedDict()
        self._max_apps = max_apps
        self._history = max(2, history)
        self._templates_per_app = templates_per_app

    def observe(self, app_key: str, lines: list[str]) -> set[int]:
        """Record one prompt (as lines) and return the indices of lines seen to vary."""
        return self.observe_hashes(app_key, [line_hash(line) if line.strip() else 0 for line in lines])

    def observe_hashes(self, app_key: str, hashes: list[int]) -> set[int]:
        """:meth:`observe` on the lines' hashes (0 for a blank line): what another replica shares."""
        current = frozenset(h for h in hashes if h)
        if not current:
            return set()
        template = self._match(app_key, current)
        if template is None:
            template = _Template(recent=deque(maxlen=self._history))
            templates = self._apps.setdefault(app_key, [])
            templates.insert(0, template)
            del templates[self._templates_per_app :]
            self._evict()
            volatile: set[int] = set()
        else:
            core = template.core
            volatile = {i for i, h in enumerate(hashes) if h and h not in core}
            templates = self._apps[app_key]
            if templates[0] is not template:  # least recently matched out, not least recently made
                templates.remove(template)
                templates.insert(0, template)
        template.add(current)
        self._apps.move_to_end(app_key)
        return volatile

    def _match(self, app_key: str, current: frozenset[int]) -> _Template | None:
        templates = self._apps.get(app_key)
        if not templates:
            return None
        best: _Template | None = None
        best_score = MIN_MATCH
        for template in templates:
            if not template.core:
                continue
            score = len(template.core & current) / len(template.core)
            if score >= best_score:
                best, best_score = template, score
        return best

    def _evict(self) -> None:
        while len(self._apps) > self._max_apps:
            self._apps.popitem(last=False)

    def __len__(self) -> int:
        return len(self._apps)
