"""The ramp as an SVG chart, written by hand (no plotting dependency).

Left: TTFT p50 against input length, one line per concurrency; a filled marker where the step
kneed (preemptions, queueing, TTFT), a dashed vertical line at the predicted critical context
length and a solid one at the measured one. Right: peak KV-cache usage per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from proxy.capacity.knee import Knee, Step

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
WIDTH, HEIGHT = 980, 420
PANEL_W, PANEL_H = 400, 300
MARGIN_L, MARGIN_T = 70, 50


def render_svg(
    steps: Sequence[Step], knees: Sequence[Knee], predicted: dict[int, int] | None = None, title: str = ""
) -> str:
    predicted = predicted or {}
    concurrencies = sorted({s.concurrency for s in steps})
    x_max = max([s.input_tokens for s in steps] + list(predicted.values()) + [1]) * 1.05
    ttft_max = max([s.ttft_p50 for s in steps] + [1e-3]) * 1.1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    panels = (
        (MARGIN_L, "TTFT p50 (s)", ttft_max, "ttft"),
        (MARGIN_L + PANEL_W + 110, "peak KV-cache usage", 1.0, "kv"),
    )
    for left, label, y_max, kind in panels:
        out += _axes(left, label, x_max, y_max, kind == "kv")
        for index, concurrency in enumerate(concurrencies):
            color = COLORS[index % len(COLORS)]
            ordered = sorted((s for s in steps if s.concurrency == concurrency), key=lambda s: s.input_tokens)

            def point(step: Step, _left: int = left, _y_max: float = y_max, _kind: str = kind) -> tuple[float, float]:
                value = step.ttft_p50 if _kind == "ttft" else step.kv_usage_max
                return _x(_left, step.input_tokens, x_max), _y(value, _y_max)

            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(point, ordered))
            out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
            knee = next((k for k in knees if k.concurrency == concurrency), None)
            for step in ordered:
                x, y = point(step)
                kneed = knee is not None and knee.knee_input is not None and step.input_tokens >= knee.knee_input
                fill = color if kneed else "white"
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{fill}" stroke="{color}"/>')
            if kind == "ttft":
                if concurrency in predicted:
                    out.append(_vline(left, predicted[concurrency], x_max, color, dashed=True))
                if knee is not None and knee.critical_context is not None and knee.reason is not None:
                    out.append(_vline(left, knee.critical_context, x_max, color, dashed=False))
    legend_y = MARGIN_T + PANEL_H + 45
    for index, concurrency in enumerate(concurrencies):
        color = COLORS[index % len(COLORS)]
        x = MARGIN_L + index * 150
        out.append(f'<rect x="{x}" y="{legend_y - 9}" width="14" height="4" fill="{color}"/>')
        out.append(f'<text x="{x + 20}" y="{legend_y - 4}">concurrency {concurrency}</text>')
    out.append(
        f'<text x="{MARGIN_L}" y="{legend_y + 16}">filled: step past the knee; dashed line: predicted critical '
        "context (KV pool / concurrency - output); solid line: measured</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _x(left: int, value: float, x_max: float) -> float:
    return left + PANEL_W * value / x_max


def _y(value: float, y_max: float) -> float:
    return MARGIN_T + PANEL_H * (1 - min(value, y_max) / y_max)


def _vline(left: int, value: float, x_max: float, color: str, *, dashed: bool) -> str:
    x = _x(left, value, x_max)
    dash = ' stroke-dasharray="6,4"' if dashed else ""
    return f'<line x1="{x:.1f}" y1="{MARGIN_T}" x2="{x:.1f}" y2="{MARGIN_T + PANEL_H}" stroke="{color}"{dash}/>'


def _axes(left: int, label: str, x_max: float, y_max: float, percent: bool) -> list[str]:
    bottom = MARGIN_T + PANEL_H
    parts = [
        f'<line x1="{left}" y1="{bottom}" x2="{left + PANEL_W}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{MARGIN_T}" x2="{left}" y2="{bottom}" stroke="black"/>',
        f'<text x="{left + PANEL_W / 2}" y="{bottom + 32}" text-anchor="middle">input tokens</text>',
        f'<text x="{left - 50}" y="{MARGIN_T - 12}">{escape(label)}</text>',
    ]
    for tick in range(5):
        x_value = x_max * tick / 4
        y_value = y_max * tick / 4
        x = _x(left, x_value, x_max)
        y = _y(y_value, y_max)
        y_text = f"{y_value:.0%}" if percent else f"{y_value:.2f}"
        parts.append(f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{x_value:,.0f}</text>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{y_text}</text>')
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + PANEL_W}" y2="{y:.1f}" stroke="#eee"/>')
    return parts
