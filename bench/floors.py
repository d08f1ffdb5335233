"""The floor of each workload shape (docs/canonicalization.md#the-floor), beside its prefill.

Each shape is an app: its requests' floor is the tokens of the lines no earlier request of the
shape carried, the model's replies counted as seen (:class:`proxy.observability.floor.FloorMeter`,
the operator page's own measure), in tokens at each request's reported prompt tokens per byte.
Requests of every protocol are read in chat shape, through the proxy's own view of their
protocol. Pure: fed exchanges, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.observability import FloorMeter
from proxy.protocols import CHAT_COMPLETIONS, MESSAGES, RESPONSES
from testbed.workload import Exchange

# Line hashes each shape remembers (a forgotten line counts again: the floor errs high).
FLOOR_LINES = 1 << 20
OVERALL = "overall"
_PROTOCOLS = {"chat": CHAT_COMPLETIONS, "messages": MESSAGES, "responses": RESPONSES}


def chat_request(body: dict[str, Any], protocol: str = "chat") -> tuple[list[Any], list[Any]]:
    """The request's messages and tools in chat shape, as the proxy's own view of ``protocol`` reads
    them (a Messages request's ``system`` and ``tool_result`` blocks, a Responses request's
    ``instructions``, ``function_call`` and ``function_call_output`` items): the text the engine
    renders, whatever the protocol."""
    view = _PROTOCOLS.get(protocol, CHAT_COMPLETIONS).view(body, None, "").chat
    messages, tools = view.get("messages"), view.get("tools")
    return (messages if isinstance(messages, list) else []), (tools if isinstance(tools, list) else [])


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
        messages, tools = chat_request(exchange.body, exchange.protocol)
        floor = meter.measure(messages, tools)
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
