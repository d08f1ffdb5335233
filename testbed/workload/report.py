"""Side-by-side tables and JSON of a direct run and a run through the proxy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from testbed.workload.runner import ScenarioResult, overall

OVERALL = "overall"


def with_overall(results: Mapping[str, ScenarioResult]) -> dict[str, ScenarioResult]:
    rows = dict(results)
    rows[OVERALL] = overall(results.values())
    return rows


def comparison_json(
    direct: Mapping[str, ScenarioResult] | None, proxied: Mapping[str, ScenarioResult] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, results in (("direct", direct), ("proxied", proxied)):
        if results is not None:
            out[label] = {name: r.to_json() for name, r in with_overall(results).items()}
    return out


def _pct(value: float) -> str:
    return f"{100 * value:5.1f}%"


def _side(result: ScenarioResult | None) -> list[str]:
    if result is None:
        return ["-", "-", "-", "-"]
    return [
        f"{result.prompt_tokens:,}",
        f"{result.cached_tokens:,}",
        _pct(result.hit_rate),
        f"{result.prefill_tokens:,}",
    ]


def format_comparison(
    direct: Mapping[str, ScenarioResult] | None,
    proxied: Mapping[str, ScenarioResult] | None,
    labels: tuple[str, str] = ("direct", "through the proxy"),
) -> str:
    """A text table: per scenario (and overall) prompt, cached, hit rate and prefill tokens."""
    rows_direct = with_overall(direct) if direct is not None else {}
    rows_proxied = with_overall(proxied) if proxied is not None else {}
    names = list(rows_direct or rows_proxied)
    header = [
        "scenario",
        "requests",
        "errors",
        "prompt",
        "cached",
        "hit",
        "prefill",
        "prompt",
        "cached",
        "hit",
        "prefill",
        "prefill saved",
    ]
    table: list[list[str]] = []
    for name in names:
        d = rows_direct.get(name)
        p = rows_proxied.get(name)
        any_side = d or p
        assert any_side is not None
        requests = "/".join(str(r.requests) for r in (d, p) if r is not None)
        errors = "/".join(str(r.errors) for r in (d, p) if r is not None)
        saved = "-"
        if d is not None and p is not None and d.prefill_tokens:
            saved = _pct(1 - p.prefill_tokens / d.prefill_tokens)
        table.append([name, requests, errors, *_side(d), *_side(p), saved])
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    direct_width = sum(widths[3:7]) + 3 * 2
    proxied_width = sum(widths[7:11]) + 3 * 2
    lead = sum(widths[:3]) + 2 * 2
    lines = [
        " " * lead + "  " + labels[0].center(direct_width, "-") + "  " + labels[1].center(proxied_width, "-"),
    ]

    def fmt(row: list[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(widths[i + 1]) for i, cell in enumerate(row[1:])]
        return "  ".join(cells)

    lines.append(fmt(header))
    for index, row in enumerate(table):
        if index == len(table) - 1:
            lines.append("-" * len(lines[1]))
        lines.append(fmt(row))
    return "\n".join(lines)
