"""The operator's page as HTML: server-rendered, no script, no external asset.

Everything that comes from a request (tenant and model names, session ids, prompt text) is hostile
input: it goes through :func:`html.escape` (quotes included) and nowhere else, and the page's
Content-Security-Policy (:data:`CONTENT_SECURITY_POLICY`) allows no script at all and only the one
style sheet below (by its hash), so markup that slipped through would still not run.

Pure: :func:`render` turns a snapshot into a string.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape

from proxy.observability.apps import App, BreakRecord, PromptPicture, Totals, Unit

CSS = """
:root { color-scheme: light; --ink: #1d232a; --mute: #5d6b78; --line: #d9dee3; --vary: #fff1c2;
  --moved: #dcebff; --both: #e8dcff; --bad: #a3261b; --good: #1d6b34; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px 48px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto,
  "DejaVu Sans", sans-serif; color: var(--ink); background: #f6f7f9; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 15px; margin: 0; display: inline; }
p.note, .mute { color: var(--mute); }
p.note { margin: 4px 0 12px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
th, td { padding: 5px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: #eef1f4; font-weight: 600; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, .mono { font: 12.5px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 12px 0 4px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px; min-width: 150px; }
.card b { display: block; font-size: 20px; }
.card span { color: var(--mute); font-size: 12px; }
meter { width: 90px; height: 12px; vertical-align: middle; }
details.app { background: #fff; border: 1px solid var(--line); border-radius: 6px; margin: 10px 0; padding: 8px 12px; }
details.app > summary { cursor: pointer; }
details.app[open] > summary { margin-bottom: 8px; }
.tag { display: inline-block; padding: 0 6px; border-radius: 3px; font-size: 12px; margin-right: 4px;
  border: 1px solid var(--line); background: #f3f5f7; }
.tag.vary { background: var(--vary); border-color: #e7cf79; }
.tag.moved { background: var(--moved); border-color: #9dc2f2; }
.ratio.high { color: var(--bad); font-weight: 600; }
.ratio.low { color: var(--good); font-weight: 600; }
table.lines { border: 1px solid var(--line); }
table.lines td { border: 0; padding: 0 8px; }
table.lines td.n { color: var(--mute); text-align: right; width: 3em; user-select: none; }
table.lines td.k { width: 9em; white-space: nowrap; }
table.lines td.t { white-space: pre-wrap; word-break: break-word; }
tr.vary td { background: var(--vary); }
tr.moved td { background: var(--moved); }
tr.vary.moved td { background: var(--both); }
.scroll { max-height: 460px; overflow: auto; border: 1px solid var(--line); }
.scroll table { border: 0; }
tr.fold td { padding: 2px 8px; color: var(--mute); }
tr.fold summary { cursor: pointer; font-size: 12px; }
.title { color: var(--mute); font-size: 12px; max-width: 30em; overflow: hidden; text-overflow: ellipsis;
  white-space: nowrap; }
h4 { margin: 14px 0 6px; font-size: 14px; }
.cols { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 16px; }
.diff del { background: #fbe1de; text-decoration: none; }
.diff ins { background: #dcf3e2; text-decoration: none; }
"""

STYLE_HASH = base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src 'sha256-{STYLE_HASH}'; img-src 'none'; script-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# Apps whose details are open when the page loads (the most prefill first).
OPEN_APPS = 3
# Where lines are marked, runs of unmarked lines longer than this plus their context are folded.
FOLD_AT_LEAST = 4
CONTEXT_LINES = 2
# An app's own last breaks shown in its details (all apps' last ``ui.breaks`` under "Last cache breaks").
APP_BREAKS_SHOWN = 5


@dataclass(frozen=True)
class SessionRow:
    id: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    context_tokens: int
    last_seen: float
    summary_messages: int | None
    budget_left: int | None


@dataclass(frozen=True)
class TenantView:
    """A tenant's sessions and budgets, as read from the session store for the page."""

    name: str
    session_limit: int | None = None
    tenant_limit: int | None = None
    tenant_used: int | None = None
    window_s: int = 0
    sessions: Sequence[SessionRow] = ()
    # Why the store could not be read ("the session store is unavailable").
    error: str | None = None


@dataclass(frozen=True)
class Snapshot:
    apps: Sequence[App]
    breaks: Sequence[BreakRecord]
    totals: Totals
    tenants: Sequence[TenantView] = ()
    show_text: bool = False
    now: float = 0.0
    version: str = ""
    canon_mode: str = ""
    notes: Sequence[str] = field(default_factory=tuple)


def render(snapshot: Snapshot) -> str:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="referrer" content="no-referrer">',
        "<title>prefix-proxy: apps and cache</title>",
        f"<style>{CSS}</style></head><body>",
        _header(snapshot),
        _apps_table(snapshot),
        _app_details(snapshot),
        _breaks_section("Last cache breaks", snapshot.breaks, snapshot, with_app=True, section_id="breaks"),
        _sessions(snapshot),
        "</body></html>",
    ]
    return "\n".join(parts)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _n(value: int) -> str:
    return f"{value:,}"


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _when(at: float, now: float) -> str:
    if not at:
        return "-"
    ago = max(0.0, now - at)
    if ago < 90:
        rel = f"{ago:.0f} s ago"
    elif ago < 5400:
        rel = f"{ago / 60:.0f} min ago"
    else:
        rel = f"{ago / 3600:.1f} h ago"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    return f'<span title="{_e(stamp)}">{_e(rel)}</span>'


def _ratio(value: float | None) -> str:
    if value is None:
        return '<span class="mute">-</span>'
    css = "high" if value >= 3 else "low" if value <= 1.5 else ""
    return f'<span class="ratio {css}">{value:.1f}×</span>'


def _app_name(app: App) -> str:
    return (
        f'<span class="tenant">{_e(app.tenant)}</span> / <span class="model">{_e(app.model)}</span>'
        f' / <code class="app-id">{_e(app.id)}</code>'
    )


def _title(app: App) -> str:
    return f'<div class="title">{_e(app.title)}</div>' if app.title else ""


def _header(snapshot: Snapshot) -> str:
    totals = snapshot.totals
    hit = totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0
    ratio = totals.prefill_tokens / totals.floor_tokens if totals.floor_tokens else None
    text_note = (
        "Prompt text is shown: <code>log_prompts</code> or <code>capture</code> is on."
        if snapshot.show_text
        else "Prompt text is hidden (digests, line counts, unit kinds and positions only): "
        "set <code>log_prompts: true</code> or <code>capture.path</code> to show it."
    )
    cards = [
        (_n(totals.apps), "apps"),
        (_n(totals.requests), "chat requests"),
        (_pct(hit), "hit rate (cached / prompt)"),
        (_n(totals.prefill_tokens), "prefill tokens computed"),
        (_n(totals.floor_tokens), "floor tokens"),
        (f"{ratio:.1f}×" if ratio is not None else "-", "prefill ÷ floor"),
    ]
    card_html = "".join(f'<div class="card"><b>{value}</b><span>{_e(label)}</span></div>' for value, label in cards)
    notes = "".join(f'<p class="note">{_e(note)}</p>' for note in snapshot.notes)
    meta = f"prefix-proxy {_e(snapshot.version)} · canonicalization <code>{_e(snapshot.canon_mode)}</code>"
    return (
        f'<header><h1>Apps and prefix cache</h1><p class="note">{meta} · {_when(snapshot.now, snapshot.now)}'
        f' (counts since this replica started; <a href="#breaks">breaks</a>, <a href="#sessions">sessions</a>)</p>'
        f'<p class="note">{text_note} The floor: per request, the tokens of the lines no earlier request of its app '
        "carried (the model's own replies count as seen); prefill ÷ floor is what is left to win.</p>"
        f'{notes}<div class="cards">{card_html}</div></header>'
    )


def _apps_table(snapshot: Snapshot) -> str:
    rows = []
    for app in snapshot.apps:
        moved = sum(count for kind, count in app.actions.items() if kind.startswith("volatile_moved"))
        picture = app.prompt
        marks = ""
        if picture is not None:
            marks = (
                f'<span class="tag vary">{len(picture.varies)} vary</span>'
                f'<span class="tag moved">{len(picture.moved)} moved</span>'
            )
        rows.append(
            f'<tr class="app" data-app="{_e(app.id)}" data-tenant="{_e(app.tenant)}" data-model="{_e(app.model)}">'
            f'<td><a href="#app-{_e(app.id)}">{_app_name(app)}</a>{_title(app)}</td>'
            f'<td class="num">{_n(app.requests)}</td><td class="num">{_n(app.sessions_seen)}</td>'
            f'<td class="num"><meter min="0" max="1" value="{app.hit_rate:.4f}"></meter> {_pct(app.hit_rate)}</td>'
            f'<td class="num">{_n(app.prompt_tokens)}</td><td class="num">{_n(app.prefill_tokens)}</td>'
            f'<td class="num">{_n(app.floor_tokens)}</td><td class="num">{_ratio(app.floor_ratio)}</td>'
            f'<td class="num">{_n(max(0, app.prefill_tokens - app.floor_tokens))}</td>'
            f'<td class="num">{_n(moved)}</td><td>{marks}</td>'
            f"<td>{_when(app.last_seen, snapshot.now)}</td></tr>"
        )
    if not rows:
        rows.append('<tr><td colspan="12" class="mute">No chat request answered yet.</td></tr>')
    head = (
        "<tr><th>app (tenant / model / template)</th><th class=num>requests</th><th class=num>sessions</th>"
        "<th class=num>hit rate</th><th class=num>prompt</th><th class=num>prefill</th><th class=num>floor</th>"
        "<th class=num>÷ floor</th><th class=num>left to win</th><th class=num>moves</th>"
        "<th>system prompt lines</th><th>last seen</th></tr>"
    )
    return f'<h2 id="apps">Apps</h2><table class="apps"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _app_details(snapshot: Snapshot) -> str:
    sections = []
    for index, app in enumerate(snapshot.apps):
        prompt_tokens, cached, floor = app.last
        actions = (
            " ".join(
                f'<span class="tag">{_e(kind)} × {_n(count)}</span>' for kind, count in sorted(app.actions.items())
            )
            or '<span class="mute">none: forwarded as sent</span>'
        )
        body = [
            f'<p class="note">Last request: prompt {_n(prompt_tokens)}, cached {_n(cached)}, '
            f"prefill {_n(max(0, prompt_tokens - cached))}, floor {_n(floor)}. "
            f"Rewrites so far: {actions}</p>",
            '<div class="cols"><div>',
            _prompt(app.prompt, snapshot.show_text),
            "</div><div>",
            _units(app.prompt),
            "</div></div>",
            _breaks_section(
                "Its last cache breaks", list(reversed(app.breaks))[:APP_BREAKS_SHOWN], snapshot, with_app=False
            ),
        ]
        sections.append(
            f'<details class="app" id="app-{_e(app.id)}"{" open" if index < OPEN_APPS else ""}>'
            f"<summary><h3>{_app_name(app)}</h3> · {_n(app.requests)} requests · hit {_pct(app.hit_rate)}"
            f" · prefill {_ratio(app.floor_ratio)} its floor</summary>{''.join(body)}</details>"
        )
    return '<h2 id="details">Per app</h2>' + "".join(sections)


def _prompt(picture: PromptPicture | None, show_text: bool) -> str:
    if picture is None or not picture.lines:
        return '<p class="mute">No system prompt.</p>'
    summary = (
        f'<p class="note">Its latest system prompt ({picture.messages} message{"s" if picture.messages != 1 else ""}, '
        f'{_n(picture.lines)} lines): <span class="tag vary">varies</span> absent from one of the app\'s recent '
        'prompts; <span class="tag moved">moved</span> forwarded elsewhere than the client put it.</p>'
    )
    if not show_text or picture.text is None:
        digests = [f"{d & 0xFFFFFFFFFFFFFFFF:016x}"[:8] if d else "(blank)" for d in picture.line_digests]
        return summary + _lines(picture, [_e(d) for d in digests], "digests mono")
    cells = [f"<code>{_e(line)}</code>" for line in picture.text.split("\n")]
    more = '<p class="note">(cut at ui.prompt_chars)</p>' if picture.truncated else ""
    return summary + _lines(picture, cells, "prompt") + more


def _lines(picture: PromptPicture, cells: list[str], css: str) -> str:
    """One row per line (its number, its marks, ``cells[i]``); where some lines are marked, each long
    run of unmarked lines folded (but its first and last :data:`CONTEXT_LINES`) into a ``<details>``."""
    marked = picture.varies | picture.moved
    rows: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if marked and len(run) > 2 * CONTEXT_LINES + FOLD_AT_LEAST:
            hidden = run[CONTEXT_LINES:-CONTEXT_LINES]
            rows.extend(run[:CONTEXT_LINES])
            rows.append(
                f'<tr class="fold"><td colspan="3"><details><summary>{_n(len(hidden))} lines neither vary nor '
                f'moved</summary><table class="lines">{"".join(hidden)}</table></details></td></tr>'
            )
            rows.extend(run[-CONTEXT_LINES:])
        else:
            rows.extend(run)
        run.clear()

    for number, cell in enumerate(cells):
        classes = " ".join(
            name for name, marks in (("vary", picture.varies), ("moved", picture.moved)) if number in marks
        )
        kind = " ".join(
            name for name, marks in (("varies", picture.varies), ("moved", picture.moved)) if number in marks
        )
        row = (
            f'<tr class="{classes}"><td class="n">{number + 1}</td><td class="k">{kind}</td>'
            f'<td class="t">{cell}</td></tr>'
        )
        if number in marked:
            flush()
            rows.append(row)
        else:
            run.append(row)
    flush()
    return f'<div class="scroll"><table class="lines {css}">{"".join(rows)}</table></div>'


def _units(picture: PromptPicture | None) -> str:
    if picture is None or not picture.units:
        return '<p class="note">No unit of its system prompt varies or moved.</p>'
    rows = []
    for unit in picture.units:
        rows.append(
            f'<tr class="unit"><td class="num">{_span(unit)}</td><td>{_unit_kind(unit)}</td>'
            f"<td>{_marks(unit)}</td><td class=num>{_n(unit.lines)}</td><td><code>{_e(unit.digest)}</code></td></tr>"
        )
    head = "<tr><th class=num>lines</th><th>unit</th><th>found</th><th class=num>non-blank</th><th>digest</th></tr>"
    return f'<table class="units"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _span(unit: Unit) -> str:
    return f"{unit.first + 1}" if unit.first == unit.last else f"{unit.first + 1}–{unit.last + 1}"


def _unit_kind(unit: Unit) -> str:
    if unit.label:
        return f"{_e(unit.kind)} <code>&lt;{_e(unit.label)}&gt;</code>"
    return _e(unit.kind)


def _marks(unit: Unit) -> str:
    tags = []
    if unit.varies:
        tags.append('<span class="tag vary">varies</span>')
    if unit.moved:
        tags.append('<span class="tag moved">moved</span>')
    return "".join(tags)


def _where(record: BreakRecord) -> str:
    if record.message is None:
        return '<span class="mute">-</span>'
    if record.message == -1:
        return "the tools"
    where = f"message {record.message}"
    if record.role:
        where += f" ({_e(record.role)})"
    if record.line is not None:
        where += f", line {record.line}"
    return where


def _difference(record: BreakRecord, show_text: bool) -> str:
    if show_text and (record.now_text is not None or record.before_text is not None):
        parts = []
        if record.before_text is not None:
            parts.append(f"<del>{_e(record.before_text)}</del>")
        if record.now_text is not None:
            parts.append(f"<ins>{_e(record.now_text)}</ins>")
        return f'<div class="diff mono">{"<br>".join(parts)}</div>'
    if record.now_digest or record.before_digest:
        before = f"<code>{_e(record.before_digest)}</code> → " if record.before_digest else ""
        return f"{before}<code>{_e(record.now_digest or '')}</code>"
    return '<span class="mute">-</span>'


def _breaks_section(
    title: str,
    records: Sequence[BreakRecord],
    snapshot: Snapshot,
    *,
    with_app: bool,
    section_id: str | None = None,
) -> str:
    anchor = f' id="{section_id}"' if section_id else ""
    heading = f"<h2{anchor}>{_e(title)}</h2>" if with_app else f"<h4>{_e(title)}</h4>"
    if not records:
        return heading + '<p class="note">None.</p>'
    rows = []
    for record in records:
        app = (
            f'<td><a href="#app-{_e(record.app)}"><code>{_e(record.app)}</code></a> '
            f"{_e(record.tenant)} / {_e(record.model)}</td>"
        )
        rows.append(
            f'<tr class="break" data-cause="{_e(record.cause)}"><td>{_when(record.at, snapshot.now)}</td>'
            f"{app if with_app else ''}<td>{_e(record.session or '-')}</td><td><b>{_e(record.cause)}</b></td>"
            f"<td>{_where(record)}</td><td class=num>{_n(record.tokens_lost)}</td>"
            f"<td>{_difference(record, snapshot.show_text)}</td></tr>"
        )
    head = (
        "<tr><th>when</th>"
        + ("<th>app</th>" if with_app else "")
        + "<th>session</th><th>cause</th><th>where the prompt first differs</th><th class=num>tokens lost</th>"
        "<th>before → now</th></tr>"
    )
    return f'{heading}<table class="breaks"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _sessions(snapshot: Snapshot) -> str:
    parts = ['<h2 id="sessions">Sessions and budgets</h2>']
    if not snapshot.tenants:
        parts.append('<p class="note">No tenant seen yet.</p>')
    for tenant in snapshot.tenants:
        parts.append(_tenant(tenant, snapshot.now))
    return "".join(parts)


def _tenant(tenant: TenantView, now: float) -> str:
    budget = []
    if tenant.tenant_limit is not None:
        used = tenant.tenant_used or 0
        budget.append(
            f"tenant budget {_n(used)} of {_n(tenant.tenant_limit)} tokens used "
            f"(<meter min=0 max={tenant.tenant_limit} value={min(used, tenant.tenant_limit)}></meter>) "
            f"per {_n(tenant.window_s)} s"
        )
    else:
        budget.append("no tenant budget")
    if tenant.session_limit is not None:
        budget.append(f"{_n(tenant.session_limit)} tokens per session per {_n(tenant.window_s)} s")
    else:
        budget.append("no session budget")
    head = (
        f'<h4 class="tenant" data-tenant="{_e(tenant.name)}">{_e(tenant.name)}</h4>'
        f'<p class="note">{" · ".join(budget)}</p>'
    )
    if tenant.error:
        return head + f'<p class="note">{_e(tenant.error)}</p>'
    if not tenant.sessions:
        return head + '<p class="note">No session recorded.</p>'
    rows = [
        f'<tr class="session"><td><code>{_e(row.id)}</code></td><td class=num>{_n(row.requests)}</td>'
        f"<td class=num>{_n(row.prompt_tokens)}</td><td class=num>{_n(row.cached_tokens)}</td>"
        f"<td class=num>{_pct(row.cached_tokens / row.prompt_tokens if row.prompt_tokens else 0.0)}</td>"
        f"<td class=num>{_n(row.context_tokens)}</td>"
        f"<td class=num>{_summary(row.summary_messages)}</td>"
        f"<td class=num>{_n(row.budget_left) if row.budget_left is not None else '-'}</td>"
        f"<td>{_when(row.last_seen, now)}</td></tr>"
        for row in tenant.sessions
    ]
    table_head = (
        "<tr><th>session</th><th class=num>requests</th><th class=num>prompt</th><th class=num>cached</th>"
        "<th class=num>hit rate</th><th class=num>context</th><th class=num>summary covers</th>"
        "<th class=num>budget left</th><th>last seen</th></tr>"
    )
    return head + f'<table class="sessions"><thead>{table_head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _summary(messages: int | None) -> str:
    return "-" if messages is None else f"{_n(messages)} messages"


def tenant_names(configured: Iterable[str], seen: Iterable[str]) -> list[str]:
    """The tenants the page lists: configured ones, then any other seen (sorted, once each)."""
    names = list(dict.fromkeys(configured))
    names.extend(sorted(set(seen) - set(names)))
    return names
