"""bench.floors reads every protocol's request as the proxy's view of that protocol does: a Responses
request's tool output and a Messages request's tool result count as the lines the engine renders."""

from __future__ import annotations

from typing import Any

from bench.floors import ShapeFloors
from testbed.workload.runner import Exchange, RequestStat

OUTPUT = "\n".join(f"row {n}: p99 {300 + n} ms" for n in range(20))


def _floor_after(earlier: dict[str, Any], body: dict[str, Any], protocol: str) -> int:
    """The floor of ``body``, sent after ``earlier`` (whose lines are then seen), in tokens of a
    400-token prompt."""
    floors = ShapeFloors()
    for step, sent in enumerate((earlier, body)):
        stat = RequestStat("s", step, 200, prompt_tokens=400)
        floors.observe(Exchange("shape", "s", step, sent, 200, None, stat, protocol))
        if step == 0:
            first = floors.tokens["shape"]
    return floors.tokens["shape"] - first


def test_a_tool_output_counts_whatever_the_protocol_carries_it_in() -> None:
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are an operations assistant."},
            {"role": "user", "content": "How is checkout?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_metrics", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": OUTPUT},
        ],
    }  # fmt: skip
    responses = {
        "model": "m",
        "instructions": "You are an operations assistant.",
        "input": [
            {"role": "user", "content": "How is checkout?"},
            {"type": "function_call", "call_id": "c1", "name": "get_metrics", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": OUTPUT},
        ],
    }
    messages = {
        "model": "m",
        "max_tokens": 64,
        "system": "You are an operations assistant.",
        "messages": [
            {"role": "user", "content": "How is checkout?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_metrics", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": OUTPUT}]},
        ],
    }
    counted = [
        _floor_after({**chat, "messages": chat["messages"][:3]}, chat, "chat"),
        _floor_after({**responses, "input": responses["input"][:2]}, responses, "responses"),
        _floor_after({**messages, "messages": messages["messages"][:2]}, messages, "messages"),
    ]
    # After a request without it, the 20 output lines are the only new ones: most of the prompt,
    # in every protocol alike.
    assert min(counted) > 200, counted
    assert max(counted) - min(counted) <= 0.15 * max(counted), counted
