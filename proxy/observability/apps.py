"""What the operator's page shows (``GET /ui``): the apps the proxy recognized and what it learned of each.

An *app* is a tenant's model and one template of system prompt: requests of a tenant and model
whose system prompts share most of their lines (the rule learned volatility matches templates by,
:mod:`proxy.canon.learned`: a prompt joins the template whose stable lines it mostly holds). Per app,
from the chat requests the proxy forwarded and the usage their answers reported:

* requests, sessions, prompt and cached tokens, the computed prefill (prompt - cached) and the floor
  (:mod:`proxy.observability.floor`), the prefill's ratio to it;
* its latest system prompt as the client sent it, each line marked as *varying* (absent from one of
  the template's recent prompts) and *moved* (not where the client put it in the forwarded prompt),
  grouped into units (a tagged block, a fence, a labelled list, a ``key: value`` line, a paragraph);
* its last cache breaks (:mod:`proxy.observability.breaks`): the cause and where the prompt first
  differs, with that line's text before and after where prompt text may be kept.

Prompt text is kept only when ``keep_text`` (the operator enabled ``log_prompts`` or ``capture``,
which keep prompts already); otherwise the lines' digests, counts, unit kinds and positions.

Bounded: ``max_apps`` apps (least recently seen out), each with a bounded floor memory, a few recent
prompts' line sets, ``breaks`` breaks and a capped prompt text. Pure: no I/O, no clock (the caller
passes the time); the caller serializes access (one event loop).
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

import xxhash

from proxy.observability.breaks import NONE, CacheBreak
from proxy.observability.digests import content_text
from proxy.observability.floor import Floor, FloorMeter, LineHashes, text_hash
from proxy.openai import STABLE_ROLES

# Template matching, as learned volatility does it (proxy.canon.learned).
MIN_MATCH = 0.6
FIRST_MATCH = 0.3
MIN_SHARE = 0.25
RECENT_PROMPTS = 8
TEMPLATES_PER_MODEL = 16
MAX_SESSIONS_COUNTED = 1024
MAX_ACTION_KINDS = 32
SNIPPET_CHARS = 240
TITLE_CHARS = 72
# Lines between the common head and tail aligned by difflib (quadratic); past it, a greedy pass.
MAX_ALIGNED_LINES = 256

_OPEN_TAG = re.compile(r"^\s*<([A-Za-z][\w.:-]*)(?:\s[^<>]*)?>")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_KEY_VALUE = re.compile(r"^\s*[\w][\w .()/-]{0,40}:\s+\S")


def short_digest(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"[:12]


@dataclass(frozen=True)
class Unit:
    """A run of marked lines of a system prompt (blank lines between them included)."""

    first: int  # 0-based line indices, inclusive
    last: int
    kind: str
    varies: bool
    moved: bool
    digest: str
    lines: int  # non-blank
    # The tag of a tagged block (only where prompt text may be kept).
    label: str | None = None


@dataclass(frozen=True)
class PromptPicture:
    """An app's latest system prompt, as the client sent it, with what the proxy found in it."""

    lines: int
    line_digests: tuple[int, ...]  # per line, 0 for a blank one
    varies: frozenset[int]
    moved: frozenset[int]
    units: tuple[Unit, ...]
    messages: int  # leading system messages it was made of
    text: str | None = None  # only where prompt text may be kept; at most ``prompt_chars``
    truncated: bool = False


@dataclass(frozen=True)
class BreakRecord:
    """One cache break, as the page shows it."""

    at: float
    app: str
    tenant: str
    model: str
    session: str | None
    cause: str
    message: int | None  # forwarded message index (-1: the tools)
    line: int | None  # 1-based line of that system message
    tokens_lost: int
    role: str | None = None
    now_digest: str | None = None
    before_digest: str | None = None
    # Only where prompt text may be kept: the differing line (or the message's start) now and before.
    now_text: str | None = None
    before_text: str | None = None


@dataclass
class _Template:
    recent: deque[frozenset[int]] = field(default_factory=lambda: deque(maxlen=RECENT_PROMPTS))
    core: frozenset[int] = frozenset()
    empty: bool = False

    def add(self, lines: frozenset[int]) -> None:
        if self.recent and self.recent[-1] == lines:
            return
        self.recent.append(lines)
        self.core = frozenset.intersection(*self.recent)


@dataclass
class App:
    id: str
    tenant: str
    model: str
    floor_meter: FloorMeter
    template: _Template
    first_seen: float
    last_seen: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    floor_tokens: int = 0
    # The last request: (prompt, cached, floor) tokens.
    last: tuple[int, int, int] = (0, 0, 0)
    sessions: set[str] = field(default_factory=set)
    actions: dict[str, int] = field(default_factory=dict)
    prompt: PromptPicture | None = None
    breaks: deque[BreakRecord] = field(default_factory=deque)
    # The previous request's forwarded stable system messages: line hashes, and text where kept.
    forwarded_system: tuple[tuple[int, ...], ...] = ()
    forwarded_text: tuple[str, ...] | None = None
    # Where prompt text may be kept: the first stable line of its system prompt, to tell apps apart.
    title: str | None = None

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def floor_ratio(self) -> float | None:
        """Computed prefill per token of floor (1.0: nothing left to win); None without a floor."""
        return self.prefill_tokens / self.floor_tokens if self.floor_tokens else None

    @property
    def sessions_seen(self) -> int:
        return len(self.sessions)


@dataclass(frozen=True)
class Totals:
    apps: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    floor_tokens: int

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


class AppBook:
    """The apps seen, least recently seen out past ``max_apps``."""

    def __init__(
        self,
        *,
        keep_text: bool = False,
        max_apps: int = 64,
        floor_lines: int = 8192,
        breaks: int = 50,
        prompt_chars: int = 32_768,
    ) -> None:
        self.keep_text = keep_text
        self._max_apps = max(1, max_apps)
        self._floor_lines = floor_lines
        self._prompt_chars = prompt_chars
        self._apps: OrderedDict[str, App] = OrderedDict()
        # (tenant, model) -> ids of its apps, most recently seen first.
        self._by_model: dict[tuple[str, str], list[str]] = {}
        self._breaks: deque[BreakRecord] = deque(maxlen=max(1, breaks))
        self._app_breaks = max(1, breaks)

    def __len__(self) -> int:
        return len(self._apps)

    # -- recording -------------------------------------------------------------------------------

    def record(
        self,
        *,
        tenant: str,
        model: str,
        client: dict[str, Any],
        forwarded: dict[str, Any],
        stable_count: int,
        actions: Sequence[str] = (),
        session: str | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        explanation: CacheBreak | None = None,
        reply: dict[str, Any] | None = None,
        now: float = 0.0,
    ) -> App:
        """One answered chat request: ``client`` as the client sent it (chat shape), ``forwarded`` as
        the backend received it (its first ``stable_count`` messages the stable system prompt), the
        backend's usage and the request's cache-break explanation (settled)."""
        messages = [m for m in client.get("messages") or [] if isinstance(m, dict)]
        system_count = 0
        for message in messages:
            if message.get("role") not in STABLE_ROLES:
                break
            system_count += 1
        system_text = "\n".join(content_text(m.get("content")) for m in messages[:system_count])
        lines = system_text.split("\n") if system_count else []
        line_hashes = LineHashes()
        hashes = line_hashes.of(lines)
        members = frozenset(h for h in hashes if h)
        app = self._app(tenant, model, members, now)
        app.template.add(members)
        floor = app.floor_meter.measure(messages, _tools(client), line_hashes)
        app.floor_meter.saw_reply(reply)
        self._account(app, floor, prompt_tokens, cached_tokens, actions, session, now)
        moving = any(a.startswith("volatile_moved") for a in actions)
        forwarded_messages = [m for m in forwarded.get("messages") or [] if isinstance(m, dict)]
        stable_texts = [content_text(m.get("content")) for m in forwarded_messages[:stable_count]]
        forwarded_system = tuple(line_hashes.of(text.split("\n")) for text in stable_texts)
        moved = _moved(hashes, forwarded_system) if moving and system_count else frozenset()
        varies = frozenset(i for i, h in enumerate(hashes) if h and h not in app.template.core)
        app.prompt = self._picture(lines, hashes, varies, moved, system_count)
        if self.keep_text:
            app.title = _title(lines, hashes, varies | moved)
        if explanation is not None and explanation.cause != NONE:
            self._record_break(app, explanation, forwarded_messages, session, now)
        app.forwarded_system = forwarded_system
        app.forwarded_text = tuple(_capped(t, self._prompt_chars) for t in stable_texts) if self.keep_text else None
        return app

    def _app(self, tenant: str, model: str, members: frozenset[int], now: float) -> App:
        key = (tenant, model)
        ids = self._by_model.setdefault(key, [])
        candidates = [self._apps[i] for i in ids if i in self._apps]
        found = _match(candidates, members)
        if found is None:
            template = _Template(empty=not members)
            app_id = _app_id(tenant, model, members)
            while app_id in self._apps:  # another template that opened with the same lines
                app_id = short_digest(xxhash.xxh3_64_intdigest(app_id.encode()))
            found = App(app_id, tenant, model, FloorMeter(self._floor_lines), template, now)
            self._apps[app_id] = found
            self._evict()
            ids = self._by_model.setdefault(key, [])
        else:
            self._apps.move_to_end(found.id)
        if found.id in ids:
            ids.remove(found.id)
        ids.insert(0, found.id)
        for dropped in ids[TEMPLATES_PER_MODEL:]:
            self._forget(dropped)
        del ids[TEMPLATES_PER_MODEL:]
        return found

    def _evict(self) -> None:
        while len(self._apps) > self._max_apps:
            oldest = next(iter(self._apps))
            self._forget(oldest)

    def _forget(self, app_id: str) -> None:
        app = self._apps.pop(app_id, None)
        if app is None:
            return
        key = (app.tenant, app.model)
        ids = self._by_model.get(key)
        if ids is not None:
            if app_id in ids:
                ids.remove(app_id)
            if not ids:
                del self._by_model[key]

    def _account(
        self,
        app: App,
        floor: Floor,
        prompt_tokens: int,
        cached_tokens: int,
        actions: Iterable[str],
        session: str | None,
        now: float,
    ) -> None:
        app.requests += 1
        app.last_seen = now
        prompt_tokens = max(0, prompt_tokens)
        cached_tokens = max(0, min(cached_tokens, prompt_tokens))
        app.prompt_tokens += prompt_tokens
        app.cached_tokens += cached_tokens
        floor_tokens = floor.tokens(prompt_tokens)
        app.floor_tokens += floor_tokens
        app.last = (prompt_tokens, cached_tokens, floor_tokens)
        if session and len(app.sessions) < MAX_SESSIONS_COUNTED:
            app.sessions.add(session)
        for action in actions:
            kind = action.partition(":")[0]
            if kind in app.actions or len(app.actions) < MAX_ACTION_KINDS:
                app.actions[kind] = app.actions.get(kind, 0) + 1

    def _picture(
        self,
        lines: list[str],
        hashes: tuple[int, ...],
        varies: frozenset[int],
        moved: frozenset[int],
        messages: int,
    ) -> PromptPicture:
        units = tuple(_units(lines, hashes, varies, moved, keep_labels=self.keep_text))
        text = None
        truncated = False
        if self.keep_text:
            joined = "\n".join(lines)
            truncated = len(joined) > self._prompt_chars
            text = joined[: self._prompt_chars]
        return PromptPicture(len(lines), hashes, varies, moved, units, messages, text, truncated)

    def _record_break(
        self,
        app: App,
        explanation: CacheBreak,
        forwarded: list[dict[str, Any]],
        session: str | None,
        now: float,
    ) -> None:
        message, line = explanation.message, explanation.line
        role = now_text = before_text = now_digest = before_digest = None
        if message is not None and 0 <= message < len(forwarded):
            target = forwarded[message]
            role = str(target.get("role"))
            text = content_text(target.get("content"))
            if line is not None:
                current = text.split("\n")
                now_line = current[line - 1] if 0 < line <= len(current) else ""
                now_hash = text_hash(now_line) if now_line.strip() else 0
                now_digest = short_digest(now_hash)
                now_text = now_line if self.keep_text else None
                if message < len(app.forwarded_system):
                    previous = app.forwarded_system[message]
                    if 0 < line <= len(previous) and previous[line - 1] != now_hash:
                        before_digest = short_digest(previous[line - 1])
                        if self.keep_text and app.forwarded_text is not None and message < len(app.forwarded_text):
                            old = app.forwarded_text[message].split("\n")
                            before_text = old[line - 1] if line <= len(old) else None
            else:
                now_digest = short_digest(text_hash(text))
                now_text = text if self.keep_text else None
        record = BreakRecord(
            at=now,
            app=app.id,
            tenant=app.tenant,
            model=app.model,
            session=session,
            cause=explanation.cause,
            message=message,
            line=line,
            tokens_lost=explanation.tokens_lost,
            role=role,
            now_digest=now_digest,
            before_digest=before_digest,
            now_text=_snippet(now_text),
            before_text=_snippet(before_text),
        )
        self._breaks.append(record)
        app.breaks.append(record)
        while len(app.breaks) > self._app_breaks:
            app.breaks.popleft()

    # -- reading ---------------------------------------------------------------------------------

    def apps(self) -> list[App]:
        """Every app, the most prefill first."""
        return sorted(self._apps.values(), key=lambda a: (-a.prefill_tokens, a.tenant, a.model, a.id))

    def breaks(self) -> list[BreakRecord]:
        """The last breaks, newest first (of apps still remembered or not)."""
        return list(reversed(self._breaks))

    def tenants(self) -> list[str]:
        return sorted({app.tenant for app in self._apps.values()})

    def totals(self) -> Totals:
        apps = list(self._apps.values())
        return Totals(
            len(apps),
            sum(a.requests for a in apps),
            sum(a.prompt_tokens for a in apps),
            sum(a.cached_tokens for a in apps),
            sum(a.floor_tokens for a in apps),
        )


def _app_id(tenant: str, model: str, members: frozenset[int]) -> str:
    digest = xxhash.xxh3_64()
    digest.update(tenant.encode("utf-8", "surrogatepass") + b"\x00" + model.encode("utf-8", "surrogatepass") + b"\x00")
    for member in sorted(members):
        digest.update(member.to_bytes(8, "little"))
    return short_digest(digest.intdigest())


def _match(apps: list[App], current: frozenset[int]) -> App | None:
    if not current:
        return next((app for app in apps if app.template.empty), None)
    best: App | None = None
    best_score = (0, 0.0)
    for app in apps:
        template = app.template
        core = template.core
        if template.empty or not core:
            continue
        shared = len(core & current)
        settled = shared >= MIN_MATCH * len(core)
        if len(template.recent) == 1:
            settled = settled or shared >= FIRST_MATCH * max(len(core), len(current))
        if not settled or shared < MIN_SHARE * len(current):
            continue
        score = (shared, shared / len(core))
        if score > best_score:
            best, best_score = app, score
    return best


def _moved(hashes: tuple[int, ...], forwarded: tuple[tuple[int, ...], ...]) -> frozenset[int]:
    """Lines of the client's system prompt (``hashes``, 0 for a blank line) that the forwarded stable
    system messages do not hold in their order: the ones the proxy moved (byte for byte, so elsewhere
    in the request: behind the stable part, or at the end of the system message). The common head and
    tail are aligned at once; what lies between by ``difflib`` (a greedy pass where it is long)."""
    ours = [(i, h) for i, h in enumerate(hashes) if h]
    kept = [h for message in forwarded for h in message if h]
    head = 0
    limit = min(len(ours), len(kept))
    while head < limit and ours[head][1] == kept[head]:
        head += 1
    tail = 0
    while tail < limit - head and ours[-1 - tail][1] == kept[-1 - tail]:
        tail += 1
    middle, known = ours[head : len(ours) - tail], kept[head : len(kept) - tail]
    aligned: set[int] = set()
    if len(middle) <= MAX_ALIGNED_LINES and len(known) <= MAX_ALIGNED_LINES:
        matcher = SequenceMatcher(None, [h for _, h in middle], known, autojunk=False)
        for start, _, size in matcher.get_matching_blocks():
            aligned.update(range(start, start + size))
    else:
        at = 0
        for position, (_, digest) in enumerate(middle):
            if at < len(known) and known[at] == digest:
                aligned.add(position)
                at += 1
    return frozenset(index for position, (index, _) in enumerate(middle) if position not in aligned)


def _units(
    lines: list[str], hashes: tuple[int, ...], varies: frozenset[int], moved: frozenset[int], *, keep_labels: bool
) -> Iterable[Unit]:
    """Runs of marked lines (blank lines between two of them bridged), each with its kind."""
    marked = sorted(varies | moved)
    runs: list[list[int]] = []
    for index in marked:
        if runs and all(not hashes[i] for i in range(runs[-1][-1] + 1, index)):
            runs[-1].append(index)
        else:
            runs.append([index])
    for run in runs:
        first, last = run[0], run[-1]
        body = [lines[i] for i in range(first, last + 1)]
        kind, label = _kind(body)
        digest = xxhash.xxh3_64()
        for i in range(first, last + 1):
            digest.update(hashes[i].to_bytes(8, "little"))
        yield Unit(
            first,
            last,
            kind,
            varies=any(i in varies for i in run),
            moved=any(i in moved for i in run),
            digest=short_digest(digest.intdigest()),
            lines=sum(1 for i in range(first, last + 1) if hashes[i]),
            label=label if keep_labels else None,
        )


def _kind(body: list[str]) -> tuple[str, str | None]:
    opening = body[0]
    tag = _OPEN_TAG.match(opening)
    if tag:
        return "tagged block", tag.group(1)
    if _FENCE.match(opening):
        return "code block", None
    stripped = opening.rstrip()
    if len(body) > 1 and stripped.endswith((":", "：")):
        return "labelled list", None
    if len(body) == 1:
        return ("key: value" if _KEY_VALUE.match(opening) else "line"), None
    return "paragraph", None


def _tools(body: dict[str, Any]) -> list[Any]:
    tools = body.get("tools") or body.get("functions") or []
    return tools if isinstance(tools, list) else []


def _capped(text: str, limit: int) -> str:
    return text[:limit]


def _title(lines: list[str], hashes: tuple[int, ...], marked: frozenset[int]) -> str | None:
    for index, line in enumerate(lines):
        if hashes[index] and index not in marked:
            stripped = line.strip()
            return stripped if len(stripped) <= TITLE_CHARS else stripped[:TITLE_CHARS] + "…"
    return None


def _snippet(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "…"
