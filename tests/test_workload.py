"""The workload generator: deterministic, realistic, and each scenario breaks the cache its own way."""

from __future__ import annotations

import importlib
import itertools
import json
import re
from importlib import resources
from typing import Any

import httpx
import pytest

from proxy.tokenization import load_encoding
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_backend
from testbed.workload import (
    Scenario,
    ScenarioResult,
    Session,
    build_sessions,
    get_scenario,
    overall,
    register_scenario,
    run_workload_async,
    scenario_names,
)
from testbed.workload.corpus import dify_nodes, knowledge_passages, placeholders, questions, tool_suite
from testbed.workload.report import comparison_json, format_comparison
from testbed.workload.runner import cached_tokens_of
from testbed.workload.session import reserialize_arguments, shuffle_keys

BUILTIN = ["dify_rag", "timestamp_user", "fc_agent", "inline_query", "stable_app"]


def scripted_reply(body: dict[str, Any], counter: list[int]) -> dict[str, Any]:
    """A deterministic stand-in for a backend: a tool call after a user turn when tools exist."""
    counter[0] += 1
    n = counter[0]
    if body.get("tools") and _user_turn(body):
        tool = body["tools"][n % len(body["tools"])]
        function = tool.get("function", tool)  # chat tools nest it; Anthropic and Responses do not
        arguments = {"b": n, "a": "x", "nested": {"z": 1, "y": [1, 2]}}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"chatcmpl-tool-{n:032x}",
                    "type": "function",
                    "function": {"name": function["name"], "arguments": json.dumps(arguments)},
                }
            ],
        }
    return {"role": "assistant", "content": f"Answer number {n}. The cache keeps stable prefixes."}


def _user_turn(body: dict[str, Any]) -> bool:
    """The request ends with the user's words (not tool results), in any protocol."""
    if "input" in body:  # Responses
        return bool(body["input"]) and body["input"][-1].get("role") == "user"
    last = body["messages"][-1]
    content = last.get("content")
    blocks = content if isinstance(content, list) else []
    return last["role"] == "user" and not any(b.get("type") == "tool_result" for b in blocks)


def drive(session: Session) -> list[dict[str, Any]]:
    """Run one session against the scripted backend; returns the bodies it sent."""
    counter = [0]
    bodies = []
    while (body := session.next_request()) is not None:
        bodies.append(body)
        session.observe(scripted_reply(body, counter))
    return bodies


def session_bodies(scenario: str, index: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    return drive(get_scenario(scenario).make_session(index, _rng(seed, scenario, index)))


def _rng(seed: int, scenario: str, index: int) -> Any:
    from testbed.workload.registry import session_rng

    return session_rng(seed, scenario, index)


def user_requests(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests that open a user turn (the last message is the user's)."""
    return [b for b in bodies if b["messages"][-1]["role"] == "user"]


# -- data ------------------------------------------------------------------------------------


def test_bundled_data_is_small_loads_from_the_package_and_has_a_notice() -> None:
    data = resources.files("testbed.workload").joinpath("data")
    files = ["dify_prompts.jsonl", "mt_bench_questions.jsonl", "NOTICE.md"]
    tool_files = [f"tools/{name}.json" for name in ("message_api", "ticket_api")]
    total = 0
    for name in files + tool_files:
        path = data
        for part in name.split("/"):
            path = path.joinpath(part)
        total += len(path.read_bytes())
    assert total < 60_000
    notice = data.joinpath("NOTICE.md").read_text(encoding="utf-8")
    for needle in (
        "svcvit/Awesome-Dify-Workflow",
        "e730ed3627e5fa56fc1668d995b83178b6b1181c",
        "ShishirPatil/gorilla",
        "6ea57973c7a6097fd7c5915698c54c17c5b1b6c8",
        "lm-sys/FastChat",
        "0e6d3e4beaab66f4d3f93db72541a4abab8af28d",
        "MIT",
        "Apache-2.0",
    ):
        assert needle in notice
    assert len(questions()) == 32
    assert all(len(q.turns) == 2 for q in questions())
    assert len(tool_suite("message_api")) == 10 and len(tool_suite("ticket_api")) == 9
    systems = [n.system for n in dify_nodes().values()]
    assert any("{{#context#}}" in s for s in systems)
    assert any(s.lstrip().startswith("## 问题") and "{{#sys.query#}}" in s[:30] for s in systems)
    assert len(knowledge_passages()) > 40


def test_placeholders_are_all_filled() -> None:
    for scenario in BUILTIN:
        for index in range(4):
            for body in session_bodies(scenario, index):
                for message in body["messages"]:
                    assert not placeholders(message.get("content") or ""), (scenario, message)


# -- registry and determinism -----------------------------------------------------------------


def test_registry_lists_builtins_in_order_and_rejects_duplicates_and_unknown_names() -> None:
    assert scenario_names()[:5] == BUILTIN
    with pytest.raises(KeyError, match="unknown scenario"):
        get_scenario("nope")
    with pytest.raises(ValueError):
        register_scenario(Scenario("dify_rag", "dup", get_scenario("dify_rag").make_session))


def test_sessions_are_interleaved_round_robin_with_3_to_6_user_turns() -> None:
    sessions = build_sessions(BUILTIN, 4, seed=7)
    assert [s.scenario for s in sessions[:5]] == BUILTIN
    assert [s.index for s in sessions[::5]] == [0, 1, 2, 3]
    assert all(3 <= len(s.user_turns) <= 6 for s in sessions)
    long_ones = build_sessions(["sliding_window", "long_session"], 20, seed=7)
    assert sorted(len(s.user_turns) for s in long_ones) == [20] * 8 + [40] * 4, "long scenarios cap their sessions"
    # Sessions of one app do not replay each other's conversation.
    for scenario in BUILTIN:
        apps = len(getattr(importlib.import_module(f"testbed.workload.scenarios.{scenario}"), "APPS", (0,)))
        for app in range(apps):
            openings = [s.user_turns[0] for s in sessions if s.scenario == scenario and s.index % apps == app]
            assert len(set(openings)) == len(openings)


def test_generator_is_deterministic_given_a_seed() -> None:
    def everything(seed: int) -> str:
        return json.dumps([drive(s) for s in build_sessions(None, 3, seed)], ensure_ascii=False)

    assert everything(1) == everything(1)
    assert everything(1) != everything(2)


def test_a_session_does_not_depend_on_the_other_sessions() -> None:
    alone = drive(build_sessions(["fc_agent"], 1, seed=3)[0])
    among_others = next(s for s in build_sessions(None, 2, seed=3) if s.session_id == "fc_agent-000")
    assert drive(among_others) == alone


# -- each scenario breaks the cache its own way --------------------------------------------------


def test_dify_rag_puts_fresh_context_at_the_top_and_resends_history_exactly() -> None:
    bodies = session_bodies("dify_rag")
    assert len(bodies) >= 3
    systems = [b["messages"][0]["content"] for b in bodies]
    for system in systems:
        assert system.index("<context>\n") < 120
        stable = system.split("\n</context>", 1)[1]
        assert len(stable) > 1000
    contexts = [s.split("<context>\n", 1)[1].split("\n</context>", 1)[0] for s in systems]
    assert len(set(contexts)) == len(contexts)
    assert len({s.split("\n</context>", 1)[1] for s in systems}) == 1
    for previous, current in itertools.pairwise(bodies):
        history = current["messages"][1:-1]
        assert history[: len(previous["messages"]) - 1] == previous["messages"][1:]


def test_timestamp_user_stamps_the_first_line_in_real_formats() -> None:
    formats = {
        "iso": re.compile(r"^Current date and time: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+08:00\nUser: \S"),
        "open_webui": re.compile(
            r"^(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), \d\d:\d\d:\d\d [AP]M\n"
            r"The user's name is \S"
        ),
        "chinese": re.compile(r"^当前时间：\d{4}年\d{1,2}月\d{1,2}日 \d\d:\d\d\n用户：\S"),
    }
    seen = set()
    for index in range(3):
        bodies = session_bodies("timestamp_user", index)
        systems = [b["messages"][0]["content"] for b in bodies]
        kind = next(k for k, pattern in formats.items() if pattern.match(systems[0]))
        seen.add(kind)
        assert all(formats[kind].match(s) for s in systems)
        first_lines = [s.split("\n", 1)[0] for s in systems]
        assert len(set(first_lines)) == len(first_lines)  # time moves on every request
        bodies_text = {s.split("\n\n", 1)[1] for s in systems}
        assert len(bodies_text) == 1 and len(load_encoding().encode(bodies_text.pop())) > 350
    assert seen == set(formats)


def test_fc_agent_reshuffles_tools_and_rebuilds_tool_call_history_every_request() -> None:
    bodies = session_bodies("fc_agent", index=2)  # message + ticket API: 19 tools
    assert len(bodies) >= 6
    names = [[t["function"]["name"] for t in b["tools"]] for b in bodies]
    assert all(8 <= len(n) <= 20 for n in names)
    assert all(sorted(n) == sorted(names[0]) for n in names)
    assert len({tuple(n) for n in names}) == len(names)  # a new order every request

    def key_orders(value: Any) -> list[Any]:
        if isinstance(value, dict):
            return [list(value), *(key_orders(v) for v in value.values())]
        if isinstance(value, list):
            return [key_orders(v) for v in value]
        return []

    first, second = bodies[0]["tools"], bodies[1]["tools"]
    by_name = {t["function"]["name"]: t for t in second}
    tool = next(t for t in first if len(t["function"]["parameters"]["properties"]) >= 2)
    other = by_name[tool["function"]["name"]]
    assert tool == other  # same value...
    assert key_orders(first) != key_orders(second)  # ...other key orders, at every level
    levels_differ = [key_orders(t) != key_orders(by_name[t["function"]["name"]]) for t in first]
    assert sum(levels_differ) >= len(first) // 2

    # History tool calls: fresh ids every request, tool results follow them, arguments re-serialized.
    ids_per_request = []
    for body in bodies:
        calls = [c for m in body["messages"] if m.get("tool_calls") for c in m["tool_calls"]]
        results = [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
        assert [c["id"] for c in calls][: len(results)] == results
        ids_per_request.append([c["id"] for c in calls])
        for call in calls:
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", call["id"])
    with_calls = [ids for ids in ids_per_request if ids]
    for earlier, later in itertools.pairwise(with_calls):
        assert not set(earlier) & set(later)
    arguments = [
        c["function"]["arguments"]
        for b in bodies
        for m in b["messages"]
        if m.get("tool_calls")
        for c in m["tool_calls"][:1]
    ]
    assert len({a for a in arguments}) > 1  # the same first call, serialized differently
    assert len({json.dumps(json.loads(a), sort_keys=True) for a in arguments[:3]}) == 1


def test_inline_query_puts_the_current_question_near_the_top() -> None:
    for index in range(2):
        bodies = user_requests(session_bodies("inline_query", index))
        for body in bodies:
            system = body["messages"][0]["content"]
            query = body["messages"][-1]["content"]
            assert system.find(query) < 60
            assert len(system) - system.find(query) - len(query) > 150  # the instruction follows
        assert len({b["messages"][0]["content"] for b in bodies}) == len(bodies)
    assert session_bodies("inline_query", 0)[0]["messages"][0]["content"].startswith('## 问题\n"""')


def test_stable_app_resends_everything_exactly() -> None:
    bodies = session_bodies("stable_app")
    assert len(bodies) >= 6
    for previous, current in itertools.pairwise(bodies):
        assert json.dumps(current["tools"]) == json.dumps(previous["tools"])
        sent = json.dumps(previous["messages"])[:-1]
        assert json.dumps(current["messages"]).startswith(sent)


def test_helpers_keep_values_but_change_bytes() -> None:
    import random

    rng = random.Random(0)
    value = {"a": 1, "b": {"c": [1, {"d": 2, "e": 3}], "f": "g"}, "h": None}
    variants = {json.dumps(shuffle_keys(value, rng)) for _ in range(20)}
    assert len(variants) > 1
    assert all(json.loads(v) == value for v in variants)
    arguments = json.dumps({"title": "VPN", "priority": 4})
    forms = {reserialize_arguments(arguments, rng) for _ in range(30)}
    assert len(forms) >= 3
    assert all(json.loads(f) == json.loads(arguments) for f in forms)


# -- runner -------------------------------------------------------------------------------------


def test_cached_tokens_missing_or_null_counts_as_zero() -> None:
    assert cached_tokens_of({"prompt_tokens": 10}) == 0
    assert cached_tokens_of({"prompt_tokens_details": None}) == 0
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": None}}) == 0
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 32}}) == 32


async def test_runner_against_the_fake_backend_counts_tokens_per_scenario() -> None:
    transport = httpx.ASGITransport(app=create_fake_backend(FakeBackendConfig()))
    seen: list[int] = []
    results = await run_workload_async(
        "http://backend/v1",
        ["stable_app", "dify_rag"],
        sessions_per_scenario=2,
        seed=0,
        transport=transport,
        progress=lambda done, total: seen.append(done),
    )
    assert list(results) == ["stable_app", "dify_rag"]
    for result in results.values():
        assert result.errors == 0 and result.sessions == 2
        assert result.requests == len(result.per_request)
        assert result.prompt_tokens == sum(r.prompt_tokens for r in result.per_request)
        assert result.prefill_tokens == result.prompt_tokens - result.cached_tokens
    assert results["stable_app"].hit_rate > 0.8
    assert results["dify_rag"].hit_rate < 0.3
    assert seen[-1] == sum(r.requests for r in results.values())
    total = overall(results.values())
    assert total.requests == sum(r.requests for r in results.values())


async def test_runner_counts_non_2xx_as_errors_and_stops_that_session() -> None:
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        calls["n"] += 1
        body = json.loads(request.content)
        assert body["model"] == "m"
        if calls["n"] == 2:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        usage = {"prompt_tokens": 100, "completion_tokens": 5}  # no details: a miss
        message = {"role": "assistant", "content": "ok"}
        return httpx.Response(200, json={"choices": [{"message": message}], "usage": usage})

    results = await run_workload_async(
        "http://x/v1", ["inline_query"], sessions_per_scenario=2, seed=0, transport=httpx.MockTransport(handler)
    )
    result = results["inline_query"]
    assert result.errors == 1
    assert "HTTP 503" in result.error_samples[0]
    assert result.cached_tokens == 0
    assert result.prompt_tokens == 100 * (result.requests - 1)
    failed = {r.session_id for r in result.per_request if r.error}
    assert sum(1 for r in result.per_request if r.session_id in failed) == 1


def test_report_formats_both_sides_and_an_overall_row() -> None:
    direct = {"a": ScenarioResult("a", requests=2, prompt_tokens=1000, cached_tokens=100)}
    proxied = {"a": ScenarioResult("a", requests=2, prompt_tokens=1000, cached_tokens=900)}
    table = format_comparison(direct, proxied)
    assert "overall" in table and "90.0%" in table and "10.0%" in table
    assert "88.9%" in table  # prefill saved: 1 - 100/900
    data = comparison_json(direct, proxied)
    assert data["proxied"]["overall"]["hit_rate"] == 0.9
    assert data["direct"]["a"]["prefill_tokens"] == 900
