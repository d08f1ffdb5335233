"""The project's workload sessions, sent as STREAMING requests, with time to first token.

Each session streams in its own protocol (``Session.protocol``): chat completions, Anthropic
Messages (time to first token: the first content block; usage from ``message_delta``) or Responses
(first output item; usage and the reply from ``response.completed``).

`testbed.workload.runner` sends non-streaming requests, so it cannot see time to first token. This
drives the same `Session` objects (`testbed.workload.registry.build_sessions`: same seed, same
sessions, same requests) with ``"stream": true`` and ``stream_options.include_usage``, assembles the
assistant message from the deltas (text and tool calls) and hands it to `Session.observe`, like a
client would. Each request's numbers land in a `TimedStat` (a `RequestStat` plus ``ttft_s`` and
``latency_s``) inside the usual `ScenarioResult`, so the workload's own report code applies.

Time to first token is measured at the client: from just before the request is sent to the first
SSE event that carries a choice (vLLM sends the ``role`` delta together with the first generated
token, i.e. after the prefill). Sessions advance in waves as in the runner: every unfinished session
sends its next request, at most ``concurrency`` in flight. ``extra_body`` is merged into every
request (``cache_salt``, to keep two runs' caches apart).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from testbed.workload.registry import build_sessions
from testbed.workload.runner import (
    RequestStat,
    ScenarioResult,
    cached_tokens_of,
    parse_actions_header,
    parse_float_header,
)
from testbed.workload.session import Session
from testbed.workload.wire import CHAT, MESSAGES, RESPONSES, WIRES

ProgressCallback = Callable[[int], None]


@dataclass
class TimedStat(RequestStat):
    """A request's outcome plus client-side timings (seconds; None when no token came back)."""

    ttft_s: float | None = None
    latency_s: float | None = None
    finish_reason: str | None = None


@dataclass
class StreamedReply:
    """What the SSE events of one response add up to."""

    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None

    def feed(self, event: dict[str, Any]) -> bool:
        """Take one decoded ``data:`` event; True when it carried a choice (a token)."""
        if isinstance(event.get("error"), dict | str):
            self.error = json.dumps(event["error"])[:200]
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta") or {}
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            slot = self.tool_calls.setdefault(
                int(call.get("index", 0)), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                slot["function"]["arguments"] += function["arguments"]
        return True

    def message(self) -> dict[str, Any]:
        """The assistant message, as a non-streaming response would have carried it."""
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[index] for index in sorted(self.tool_calls)]
        return message


@dataclass
class AnthropicReply(StreamedReply):
    """What the typed events of one Anthropic Messages stream add up to."""

    def feed(self, event: dict[str, Any]) -> bool:
        kind = event.get("type")
        if kind == "error":
            self.error = json.dumps(event.get("error"))[:200]
        elif kind == "message_delta":
            self.usage = event.get("usage") if isinstance(event.get("usage"), dict) else self.usage
            self.finish_reason = (event.get("delta") or {}).get("stop_reason")
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                self.tool_calls[int(event.get("index", 0))] = {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
            return True
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.content.append(str(delta.get("text", "")))
            elif delta.get("type") == "input_json_delta" and int(event.get("index", 0)) in self.tool_calls:
                self.tool_calls[int(event.get("index", 0))]["function"]["arguments"] += delta.get("partial_json", "")
            return True
        return False

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        for call in calls:  # as a client re-sends it: the parsed input, dumped again
            try:
                parsed = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:  # cut short by max_tokens: the client has no input to re-send
                parsed = {}
            call["function"]["arguments"] = json.dumps(parsed)
        if calls:
            message["tool_calls"] = calls
        return message

    def counts(self) -> tuple[int, int, int]:
        return MESSAGES.usage({"usage": self.usage})


@dataclass
class ResponsesReply:
    """A Responses stream: the whole answer arrives in ``response.completed``."""

    answer: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None

    def feed(self, event: dict[str, Any]) -> bool:
        kind = str(event.get("type"))
        if kind in ("error", "response.failed"):
            self.error = json.dumps(event)[:200]
        elif kind == "response.completed" and isinstance(event.get("response"), dict):
            self.answer = event["response"]
            self.usage = self.answer.get("usage")
            self.finish_reason = str(self.answer.get("status"))
        return kind in ("response.output_text.delta", "response.output_item.added")

    def message(self) -> dict[str, Any]:
        return RESPONSES.message(self.answer)

    def counts(self) -> tuple[int, int, int]:
        return RESPONSES.usage(self.answer)


def _reply_for(protocol: str) -> Any:
    return {"messages": AnthropicReply, "responses": ResponsesReply}.get(protocol, StreamedReply)()


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    session_id: str,
    protocol: str = "chat",
    headers: dict[str, str] | None = None,
) -> tuple[TimedStat, dict[str, Any] | None]:
    """POST one streaming request; returns its stat and the assembled assistant message."""
    started = time.perf_counter()
    reply = _reply_for(protocol)
    ttft: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            actions = parse_actions_header(response.headers.get("x-prefix-proxy-actions"))
            overhead = parse_float_header(response.headers.get("x-prefix-proxy-overhead-ms"))
            if not response.is_success:
                text = (await response.aread()).decode(errors="replace")[:200].replace("\n", " ")
                stat = TimedStat(session_id, 0, response.status_code, error=f"HTTP {response.status_code}: {text}")
                return stat, None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    reply.error = f"undecodable event: {data[:100]!r}"
                    continue
                if isinstance(event, dict) and reply.feed(event) and ttft is None:
                    ttft = time.perf_counter() - started
            status = response.status_code
    except httpx.HTTPError as exc:
        return TimedStat(session_id, 0, 0, error=f"{type(exc).__name__}: {exc}"), None
    latency = time.perf_counter() - started
    if reply.error is None and ttft is None:
        reply.error = "stream ended without a token"
    if reply.error is None and reply.usage is None:
        reply.error = "stream ended without usage"
    usage = reply.usage or {}
    if isinstance(reply, StreamedReply):
        counts = (_int(usage.get("prompt_tokens")), cached_tokens_of(usage), _int(usage.get("completion_tokens")))
    else:
        counts = reply.counts()
    stat = TimedStat(
        session_id,
        0,
        status,
        prompt_tokens=counts[0],
        cached_tokens=counts[1],
        completion_tokens=counts[2],
        error=reply.error,
        actions=actions,
        overhead_ms=overhead,
        ttft_s=ttft,
        latency_s=latency,
        finish_reason=reply.finish_reason,
    )
    return stat, (None if reply.error else reply.message())


async def run_sessions_streaming(
    base_url: str,
    sessions: list[Session],
    *,
    model: str,
    max_tokens: int | None = 32,
    concurrency: int = 1,
    extra_body: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    progress: ProgressCallback | None = None,
) -> dict[str, ScenarioResult]:
    """Play ``sessions`` against ``base_url`` (an OpenAI base URL ending in /v1), streaming.

    Returns one `ScenarioResult` per scenario (in the order the sessions name them); its
    ``per_request`` entries are `TimedStat`s in completion order.
    """
    results: dict[str, ScenarioResult] = {}
    for session in sessions:
        results.setdefault(session.scenario, ScenarioResult(session.scenario)).sessions += 1
    semaphore = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))
    done = 0

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:

        async def step(session: Session) -> None:
            nonlocal done
            body = session.next_request()
            if body is None:
                return
            wire = WIRES[session.protocol]
            body = {"model": model, **body, **(extra_body or {})}
            body["stream"] = True
            if wire is CHAT:
                body["stream_options"] = {"include_usage": True}
            if max_tokens is not None:
                body[wire.max_tokens_key] = max_tokens
            step_index = session.requests_sent
            url = base_url.rstrip("/") + wire.path
            async with semaphore:
                stat, message = await stream_chat(
                    client, url, body, session.session_id, session.protocol, session.extra_headers()
                )
            stat.step = step_index
            if message is not None:
                session.observe(message)
            else:
                session.fail()
            results[session.scenario].add(stat)
            done += 1
            if progress is not None:
                progress(done)

        pending = list(sessions)
        while pending:
            await asyncio.gather(*(step(session) for session in pending))
            pending = [session for session in pending if not session.done]
    return results


def make_sessions(scenarios: Iterable[str], sessions_per_scenario: int, seed: int, max_user_turns: int | None = None):
    """`build_sessions`, optionally cut to the first ``max_user_turns`` user turns per session."""
    sessions = build_sessions(list(scenarios), sessions_per_scenario, seed)
    if max_user_turns is not None:
        for session in sessions:
            session.user_turns = session.user_turns[:max_user_turns]
    return sessions


def timed(result: ScenarioResult) -> list[TimedStat]:
    """The successful requests' `TimedStat`s of a result."""
    return [s for s in result.per_request if isinstance(s, TimedStat) and s.error is None]


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) else 0
