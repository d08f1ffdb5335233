"""Running the workload against an OpenAI-compatible server and measuring prefix-cache reuse.

Each session speaks one protocol (``Session.protocol``: chat completions, Anthropic Messages or
Responses, see ``wire``); reuse is read from each answer's usage in that protocol's terms.

Sessions advance in waves, round-robin: every unfinished session sends its next request,
at most ``concurrency`` in flight, then the next wave starts. Reuse is read from each
response's ``usage``: ``prompt_tokens_details.cached_tokens`` (missing or null counts as 0,
which is how vLLM reports a miss).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from testbed.workload.registry import build_sessions, resolve_scenarios
from testbed.workload.session import Session
from testbed.workload.wire import CHAT, WIRES, Wire

ProgressCallback = Callable[[int, int], None]

MAX_ERROR_SAMPLES = 5


@dataclass
class RequestStat:
    """One request's outcome (``status`` 0: no HTTP response at all)."""

    session_id: str
    step: int
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    #: what the proxy reported doing (``x-prefix-proxy-actions``; empty when direct)
    actions: tuple[str, ...] = ()
    #: the proxy's own time (``x-prefix-proxy-overhead-ms``), None when direct
    overhead_ms: float | None = None


@dataclass
class ScenarioResult:
    scenario: str
    sessions: int = 0
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error_samples: list[str] = field(default_factory=list)
    #: requests per proxy action kind (e.g. ``volatile_moved``, ``tools_canonicalized``)
    actions: Counter[str] = field(default_factory=Counter)
    overhead_ms_total: float = 0.0
    overhead_samples: int = 0
    per_request: list[RequestStat] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the server had to compute."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def mean_overhead_ms(self) -> float | None:
        return self.overhead_ms_total / self.overhead_samples if self.overhead_samples else None

    def add(self, stat: RequestStat) -> None:
        self.requests += 1
        self.per_request.append(stat)
        if stat.error is not None:
            self.errors += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{stat.session_id}#{stat.step}: {stat.error}")
            return
        self.prompt_tokens += stat.prompt_tokens
        self.cached_tokens += stat.cached_tokens
        self.completion_tokens += stat.completion_tokens
        self.actions.update({action.split(":", 1)[0] for action in stat.actions})
        if stat.overhead_ms is not None:
            self.overhead_ms_total += stat.overhead_ms
            self.overhead_samples += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "sessions": self.sessions,
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "prefill_tokens": self.prefill_tokens,
            "error_samples": list(self.error_samples),
            "proxy_actions": dict(sorted(self.actions.items())),
            "proxy_overhead_ms_mean": None if self.mean_overhead_ms is None else round(self.mean_overhead_ms, 3),
        }


def overall(results: Iterable[ScenarioResult], name: str = "overall") -> ScenarioResult:
    """All scenarios' results summed (per-request details left out)."""
    total = ScenarioResult(name)
    for result in results:
        total.sessions += result.sessions
        total.requests += result.requests
        total.errors += result.errors
        total.prompt_tokens += result.prompt_tokens
        total.cached_tokens += result.cached_tokens
        total.completion_tokens += result.completion_tokens
        total.actions.update(result.actions)
        total.overhead_ms_total += result.overhead_ms_total
        total.overhead_samples += result.overhead_samples
        total.error_samples.extend(result.error_samples[: MAX_ERROR_SAMPLES - len(total.error_samples)])
    return total


@dataclass
class Exchange:
    """One request as sent and what came back (for recording / dumping)."""

    scenario: str
    session_id: str
    step: int
    body: dict[str, Any]
    status: int
    response: Any
    stat: RequestStat
    # The session's protocol (``Session.protocol``): how ``body`` reads.
    protocol: str = "chat"


ExchangeCallback = Callable[[Exchange], None]


def cached_tokens_of(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return 0
    value = details.get("cached_tokens")
    return int(value) if isinstance(value, int) else 0


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) else 0


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass model=")
    return str(models[0]["id"])


async def run_workload_async(
    base_url: str,
    scenarios: Iterable[str] | str | None = None,
    *,
    sessions_per_scenario: int = 8,
    seed: int = 0,
    model: str | None = None,
    concurrency: int = 8,
    max_tokens: int | None = 256,
    api_key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    progress: ProgressCallback | None = None,
    on_exchange: ExchangeCallback | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, ScenarioResult]:
    """Run the workload against ``base_url`` (the OpenAI base URL, e.g. ``http://host:8000/v1``).

    ``model`` defaults to the first one ``GET {base_url}/models`` lists. ``progress`` is called
    as ``progress(done, expected)`` after every request. Returns results by scenario name, in
    the order the scenarios were given.
    """
    base_url = base_url.rstrip("/")
    names = [s.name for s in resolve_scenarios(scenarios)]
    sessions = build_sessions(names, sessions_per_scenario, seed)
    results = {name: ScenarioResult(name) for name in names}
    for session in sessions:
        results[session.scenario].sessions += 1
    expected = sum(s.expected_requests for s in sessions)
    done = 0
    semaphore = asyncio.Semaphore(max(1, concurrency))
    request_headers = dict(headers or {})
    if api_key:
        request_headers["authorization"] = f"Bearer {api_key}"
    limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        headers=request_headers,
        limits=limits,
        transport=transport,
    ) as client:
        if model is None:
            model = await discover_model(client, base_url)

        async def step(session: Session) -> None:
            nonlocal done, expected
            body = session.next_request()
            if body is None:
                return
            wire = WIRES[session.protocol]
            body = {"model": model, **body}
            if max_tokens is not None:
                body[wire.max_tokens_key] = max_tokens
            step_index = session.requests_sent
            async with semaphore:
                stat, payload = await _post(
                    client, f"{base_url}{wire.path}", body, session.session_id, wire, session.extra_headers()
                )
            stat.step = step_index
            if stat.error is None:
                session.on_answer(payload)
                session.observe(wire.message(payload))
            else:
                session.fail()
            results[session.scenario].add(stat)
            if on_exchange is not None:
                on_exchange(
                    Exchange(
                        session.scenario, session.session_id, step_index, body, stat.status, payload, stat,
                        session.protocol,
                    )
                )
            done += 1
            expected = max(expected, done)
            if progress is not None:
                progress(done, expected)

        # One protocol after the other: the chat scenarios' waves (and so their results) are the
        # same whether or not scenarios of other protocols run too.
        groups: dict[str, list[Session]] = {}
        for session in sessions:
            groups.setdefault(session.protocol, []).append(session)
        for group in groups.values():
            pending = list(group)
            while pending:
                await asyncio.gather(*(step(session) for session in pending))
                pending = [session for session in pending if not session.done]
                # Sessions that ended early (errors, fewer tool calls) no longer count as expected.
                expected = done + sum(_remaining(s) for s in sessions if not s.done)
                if progress is not None:
                    progress(done, expected)
    return results


def _remaining(session: Session) -> int:
    return max(session.expected_requests - session.requests_sent, 1)


async def _post(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    session_id: str,
    wire: Wire = CHAT,
    headers: dict[str, str] | None = None,
) -> tuple[RequestStat, Any]:
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return RequestStat(session_id, 0, 0, error=f"{type(exc).__name__}: {exc}"), None
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if not response.is_success:
        detail = response.text[:200].replace("\n", " ")
        return RequestStat(session_id, 0, response.status_code, error=f"HTTP {response.status_code}: {detail}"), payload
    try:
        wire.message(payload)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        return RequestStat(session_id, 0, response.status_code, error=f"malformed response: {exc!r}"), payload
    prompt_tokens, cached_tokens, completion_tokens = wire.usage(payload)
    return (
        RequestStat(
            session_id,
            0,
            response.status_code,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            actions=parse_actions_header(response.headers.get("x-prefix-proxy-actions")),
            overhead_ms=parse_float_header(response.headers.get("x-prefix-proxy-overhead-ms")),
        ),
        payload,
    )


def parse_actions_header(header: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in header.split(",") if a.strip()) if header else ()


def parse_float_header(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def run_workload(
    base_url: str,
    scenarios: Iterable[str] | str | None = None,
    *,
    sessions_per_scenario: int = 8,
    seed: int = 0,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> dict[str, ScenarioResult]:
    """Synchronous :func:`run_workload_async` (runs its own event loop)."""
    return asyncio.run(
        run_workload_async(
            base_url,
            scenarios,
            sessions_per_scenario=sessions_per_scenario,
            seed=seed,
            progress=progress,
            **options,
        )
    )
