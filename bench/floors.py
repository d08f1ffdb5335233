"""The floor of each workload shape (docs/canonicalization.md#the-floor), beside its prefill.

Each shape is an app: its requests' floor is the tokens of the lines no earlier request of the
shape carried, the model's replies counted as seen (:class:`proxy.observability.floor.FloorMeter`,
the operator page's own measure), in tokens at each request's reported prompt tokens per byte.
Requests of every protocol are read in chat shape (a Messages request's ``system``, a Responses
request's ``instructions`` and ``input``). Pure: fed exchanges, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.observability import FloorMeter
from testbed.workload import Exchange

# Line hashes each shape remembers (a forgotten line counts again: the floor errs high).
FLOOR_LINES = 1 << 20
OVERALL = "overall"


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages in chat shape, whatever its protocol."""
    messages: list[dict[str, Any]] = []
    system = body.get("system") if body.get("system") is not None else body.get("instructions")
    if system is not None:
        messages.append({"role": "system", "content": system})
    for source in (body.get("messages"), body.get("input")):
        if isinstance(source, str):
            messages.append({"role": "user", "content": source})
        elif isinstance(source, list):
            messages += [m for m in source if isinstance(m, dict)]
    return messages


def reply_message(payload: Any) -> dict[str, Any] | None:
    """The assistant's reply in an answer of any protocol (None when it holds none)."""
    if not isinstance(payload, dict):
        return None
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    content = payload.get("content") if "content" in payload else payload.get("output")
    if isinstance(content, list):
        return {"role": "assistant", "content": content}
    return None


class ShapeFloors:
    """Per shape, the floor tokens of the requests seen."""

    def __init__(self) -> None:
        self._meters: dict[str, FloorMeter] = {}
        self.tokens: dict[str, int] = {}
        self.requests = 0

    def observe(self, exchange: Exchange) -> None:
        meter = self._meters.get(exchange.scenario)
        if meter is None:
            meter = self._meters[exchange.scenario] = FloorMeter(FLOOR_LINES)
        body = exchange.body
        tools = body.get("tools") if isinstance(body.get("tools"), list) else ()
        floor = meter.measure(chat_messages(body), tools or ())
        meter.saw_reply(reply_message(exchange.response))
        self.tokens[exchange.scenario] = self.tokens.get(exchange.scenario, 0) + floor.tokens(
            exchange.stat.prompt_tokens
        )
        self.requests += 1

    def rows(
        self, direct: Mapping[str, int] | None, proxied: Mapping[str, int] | None
    ) -> list[tuple[str, int | None, int | None, int]]:
        """(shape, direct prefill, proxy prefill, floor), then the overall row."""
        names = list(direct or proxied or self.tokens)
        rows = [(name, (direct or {}).get(name), (proxied or {}).get(name), self.tokens.get(name, 0)) for name in names]

        def total(column: Mapping[str, int] | None) -> int | None:
            return sum(column.get(name, 0) for name in names) if column is not None else None

        rows.append((OVERALL, total(direct), total(proxied), sum(self.tokens.get(name, 0) for name in names)))
        return rows

    def to_json(self, direct: Mapping[str, int] | None, proxied: Mapping[str, int] | None) -> dict[str, Any]:
        return {
            name: {
                "direct_prefill": d,
                "proxy_prefill": p,
                "floor": floor,
                "direct_over_floor": _ratio(d, floor),
                "proxy_over_floor": _ratio(p, floor),
            }
            for name, d, p, floor in self.rows(direct, proxied)
        }

    def format_table(self, direct: Mapping[str, int] | None, proxied: Mapping[str, int] | None) -> str:
        header = f"{'shape':<20} {'direct':>10} {'proxy':>10} {'floor':>9} {'direct/floor':>13} {'proxy/floor':>12}"
        lines = ["Prefill against the floor (tokens no arrangement can avoid):", header]
        for name, d, p, floor in self.rows(direct, proxied):
            lines.append(
                f"{name:<20} {_n(d):>10} {_n(p):>10} {floor:>9,} {_x(_ratio(d, floor)):>13} {_x(_ratio(p, floor)):>12}"
            )
        return "\n".join(lines)


def _ratio(value: int | None, floor: int) -> float | None:
    return round(value / floor, 2) if value is not None and floor else None


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
