"""The agentic scenarios: what their clients send, and what the proxy makes of it."""

from __future__ import annotations

from typing import Any

from testbed.demo import run_demo
from tests.helpers import LiveServer
from tests.test_workload import session_bodies


def test_coding_agent_requests_look_like_an_anthropic_coding_client() -> None:
    bodies = session_bodies("coding_agent", 0)
    assert len(bodies) >= 4
    first = bodies[0]
    assert 15 <= len(first["tools"]) <= 25 and first["max_tokens"] == 1024
    billing, _, instructions = first["system"]
    assert billing["text"].startswith("x-anthropic-billing-header")
    assert "<env>" in instructions["text"] and "gitStatus" in instructions["text"]
    assert instructions["cache_control"] == {"type": "ephemeral"}
    # The environment stays for the session; the attribution hash changes with every request.
    assert all(b["system"][2]["text"] == instructions["text"] for b in bodies)
    assert len({b["system"][0]["text"] for b in bodies}) == len(bodies)
    # One breakpoint on the newest block; tool results as blocks of user turns.
    for body in bodies:
        marked = [blk for m in body["messages"] for blk in m["content"] if "cache_control" in blk]
        assert marked == [body["messages"][-1]["content"][-1]]
    assert any(blk.get("type") == "tool_result" for b in bodies for m in b["messages"] for blk in m["content"])
    other = session_bodies("coding_agent", 1)[0]
    assert other["system"][2]["text"] != instructions["text"]  # another session, another environment


def test_responses_agent_re_sends_its_input() -> None:
    bodies = session_bodies("responses_agent", 0)
    kinds = {item.get("type", item.get("role")) for b in bodies for item in b["input"]}
    assert {"user", "function_call", "function_call_output"} <= kinds
    assert all(b["store"] is False and len(b["tools"]) == 10 for b in bodies)
    times = [b["instructions"].rsplit("\n", 1)[-1] for b in bodies]
    assert times[0].startswith("Current date and time:") and len(set(times)) > 1


def test_agentic_rows_of_the_demo(fake_backend: LiveServer) -> None:
    result = run_demo(sessions=3, scenarios="coding_agent,responses_agent", progress=False)
    assert result.errors == 0
    for name in ("coding_agent", "responses_agent"):
        direct: Any = result.direct[name]
        proxied: Any = result.proxied[name]
        assert proxied.requests == direct.requests > 0
        assert proxied.prefill_tokens < direct.prefill_tokens, name
    assert result.proxied["coding_agent"].actions["volatile_moved"] > 0
