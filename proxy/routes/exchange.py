"""One exchange with the upstream: a request goes out, an :data:`UpstreamAnswer` comes back.

As httpx's ``send(request, stream=...)``: :func:`send` returns a value and takes no callbacks. A
whole answer (JSON, success or error) is read and checked; a streaming one is an open relay the
client's response will iterate. :func:`respond` makes the client's response of either, and every
response ends the same way after it is sent (``proxy.routes.forward.after_response``): the
answer's :class:`AnswerEnding` records what the answer means (a session's turn, a budget), then
the metrics and the access line.

How a stream ended is known only when its response has been sent: the relay response tells the
ending (:meth:`AnswerEnding.completed` or :meth:`AnswerEnding.cut_short`); a whole answer is in
the caller's hands, which tells the ending itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState
from proxy.backends import BACKEND_EXTENSION, INVALID_ANSWER, NO_FIRST_TOKEN, STREAM_CUT, TRIAL_EXTENSION
from proxy.http import (
    PROTOCOL_FAILURES,
    DeadlineExceeded,
    RelayResponse,
    RequestContext,
    SSERelay,
    StreamEnd,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    json_bytes,
    overhead_header,
)
from proxy.openai import Usage, dumps, loads
from proxy.routes.forward import (
    AnswerEnding,
    after_response,
    credential_scrubber,
    proxy_headers,
    upstream_headers,
    whole_answer,
)

UsageReader = Callable[[Any], Usage | None]


@dataclass(frozen=True)
class Wire:
    """How a route's answers read: the upstream path, its usage, its events, and the list a
    successful whole answer holds (an answer without it is no answer, however it is labelled)."""

    path: str
    read_usage: UsageReader = Usage.from_openai
    relay_class: type[SSERelay] = SSERelay
    answer_list: str | None = None


@dataclass
class WholeAnswer:
    """The upstream's whole answer: its status and bytes, and for a success the JSON object and
    the usage it reports (None when it reports none that could be true)."""

    status: int
    raw: bytes
    headers: httpx.Headers
    parsed: dict[str, Any] | None = None
    usage: Usage | None = None

    @property
    def ok(self) -> bool:
        return self.status < 400


@dataclass
class StreamingAnswer:
    """An event stream, open: the relay reads it as the client's response iterates it. ``body``:
    what the client's response iterates, the relay's events (its first already read, see
    :func:`send`)."""

    relay: SSERelay
    body: AsyncIterable[bytes] | None = None


UpstreamAnswer = WholeAnswer | StreamingAnswer


async def send(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    wire: Wire,
    payload: bytes | None,
    *,
    stream: bool = False,
    method: str = "POST",
    backend: str | None = None,
    client_wants_usage: bool = True,
    record_content: bool = False,
    on_answer: Callable[[dict[str, Any]], None] | None = None,
    answer_fields: dict[str, Any] | None = None,
) -> UpstreamAnswer:
    """Send ``payload`` to ``wire.path`` and return the answer; raises :class:`ProxyError` when
    none came (unreachable, timed out, not the protocol). ``backend``: only that backend may answer
    (it holds state the request refers to). A stream request the upstream answers with one JSON
    body (some servers ignore ``stream``) is a whole answer. ``answer_fields``: added to a
    successful answer's object (what the client asked the proxy for, cache diagnostics).

    Passive health beyond the status: an answer that came but is unusable (a success that is not
    the protocol, a stream that ends or breaks before its first event, no first token and no answer
    to a health check either) counts against its backend, which is ejected, and while nothing has
    reached the client the request goes to the next backend in service (``routing.max_retries``).
    A whole answer's or a stream's first event is therefore read before the client's response
    starts; the rest of a stream is relayed as it comes."""
    pool = state.backends
    attempts = _Attempts(state, ctx, pool.outliers.max_retries if backend is None else 0)
    async with within_deadline(ctx):
        while True:
            ctx.mark_upstream_sent()
            response = await _opened(state, request, ctx, wire, payload, method, backend, attempts.excluded())
            if response is None:  # hung: no answer, no health check either
                if attempts.again(NO_FIRST_TOKEN):
                    continue
                raise _no_first_token(pool.outliers.first_token_timeout_s)
            ctx.backend = response.extensions.get(BACKEND_EXTENSION)
            ctx.upstream_headers_at = time.perf_counter()
            ctx.status = response.status_code
            if stream and response.status_code < 400 and _is_event_stream(response):
                relay = wire.relay_class(
                    response,
                    client_wants_usage=client_wants_usage,
                    record_content=record_content,
                    max_event_bytes=state.settings.max_sse_event_bytes,
                    dialect=ctx.dialect,
                    scrub=credential_scrubber(state, ctx),
                    on_answer=on_answer,
                    answer_fields=answer_fields,
                )
                # A backend's trial is relayed once it is whole: a backend ejected for breaking its
                # streams must not break a client's to prove it still does.
                primed = await _primed(state, ctx, relay, whole=bool(response.extensions.get(TRIAL_EXTENSION)))
                if primed is not None:
                    # Its first event read: the upstream's time so far (the relay runs at its pace).
                    ctx.upstream_headers_at = time.perf_counter()
                why = _unusable_start(relay)
                if why is not None and attempts.again(why):
                    await relay.aclose()
                    continue
                if why == NO_FIRST_TOKEN:
                    await relay.aclose()
                    raise _no_first_token(pool.outliers.first_token_timeout_s)
                if why is None:
                    attempts.count()  # another backend answered what these failed
                return StreamingAnswer(relay, primed)
            try:
                raw = await pool.read(response)
            except UpstreamConnectionLost:
                # Its headers, then the connection dropped: nothing of it reached the client.
                if attempts.again(STREAM_CUT):
                    continue
                raise
            ctx.upstream_done_at = time.perf_counter()
            ctx.stream = False
            answer = WholeAnswer(response.status_code, raw, response.headers)
            if answer.ok:
                try:
                    answer.parsed, answer.usage = _checked(state, ctx, raw, wire)
                except UpstreamProtocolError:
                    if attempts.again(INVALID_ANSWER):
                        continue
                    raise
                if answer_fields:
                    answer.raw = with_fields(raw, answer_fields)
            attempts.count()
            return answer


def _no_first_token(deadline_s: float) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"no first token within {deadline_s:g} s (routing.first_token_timeout_s), and the backend "
        "did not answer a health check either"
    )


class _Attempts:
    """The backends whose answers to one request were unusable, and the retries left."""

    def __init__(self, state: ProxyState, ctx: RequestContext, retries: int) -> None:
        self._state, self._ctx, self._retries = state, ctx, retries
        self._unusable: list[tuple[str | None, str]] = []

    def excluded(self) -> list[str]:
        return [name for name, _ in self._unusable if name is not None]

    def again(self, why: str) -> bool:
        """The answer of ``ctx.backend`` was unusable (``why``): whether to send the request again
        to another backend in service."""
        ctx = self._ctx
        self._unusable.append((ctx.backend, why))
        if why == NO_FIRST_TOKEN:
            # It did not answer a health check either: its own state, whatever the request.
            self._state.backends.answer_unusable(ctx.backend, why, ctx.model)
        if not self._retries or not self._state.backends.retry_possible(self.excluded(), ctx.route_key, ctx.model):
            return False
        self._retries -= 1
        ctx.upstream_over()  # the unusable answer's time is upstream time, not the proxy's
        return True

    def count(self) -> None:
        """Another backend answered this request: the unusable answers were their backends' failures
        (as a 5xx is counted only once another backend answered the request)."""
        ctx = self._ctx
        for name, why in self._unusable:
            if name != ctx.backend and why != NO_FIRST_TOKEN:
                self._state.backends.answer_unusable(name, why, ctx.model)


async def _opened(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    wire: Wire,
    payload: bytes | None,
    method: str,
    backend: str | None,
    excluded: list[str],
) -> httpx.Response | None:
    """The upstream's response, its headers come; None when they did not come within the first-token
    deadline and the backend it went to did not answer a health check either (it is hung).
    ``ctx.backend``: where it went."""
    pool = state.backends
    attempted: list[str] = []
    opening = pool.open(
        method,
        wire.path,
        content=payload,
        headers=upstream_headers(state, request, ctx),
        key=ctx.route_key,
        model=ctx.model,
        pinned_to=backend,
        exclude=excluded,
        attempted=attempted,
    )
    deadline = pool.outliers.first_token_timeout_s
    if pool.single or not deadline:
        return await opening
    task = asyncio.ensure_future(opening)
    if await _alive_past(state, task, deadline, attempted):
        return await task
    ctx.backend = attempted[-1] if attempted else None
    await _cancelled(task)
    return None


async def _alive_past(state: ProxyState, task: asyncio.Future[Any], deadline: float, attempted: list[str]) -> bool:
    """Wait for ``task`` up to ``deadline``; past it, whether the backend it is waiting on still
    answers a health check (then it is slow, not hung: the caller goes on waiting)."""
    try:
        done, _ = await asyncio.wait((task,), timeout=deadline)
    except BaseException:
        await _cancelled(task)
        raise
    if done:
        return True
    try:
        alive = await state.backends.probe_alive(attempted[-1] if attempted else None)
    except BaseException:
        await _cancelled(task)
        raise
    return alive or task.done()


async def _cancelled(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        result = await task
        if isinstance(result, httpx.Response):
            await result.aclose()


# A stream's start that is no answer: it ended or broke before its first event, or was not the protocol.
_UNUSABLE_STARTS = {"interrupted": STREAM_CUT, "truncated": STREAM_CUT, "invalid_event": INVALID_ANSWER}


class _Primed:
    """A relay's events with the first ones already read (what the client's response iterates)."""

    def __init__(self, read: list[bytes], events: AsyncIterator[bytes]) -> None:
        self._read = read
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if not self._read:
            return
        read, self._read = self._read, []
        for chunk in read:
            yield chunk
        async for event in self._events:
            yield event


async def _primed(state: ProxyState, ctx: RequestContext, relay: SSERelay, *, whole: bool = False) -> _Primed | None:
    """``relay``'s first event read (within the first-token deadline, then as long as the backend
    answers a health check), or with ``whole`` all of it: nothing reaches the client before the
    stream is known to be one. None where there is nowhere else to send it (one backend, or the
    deadline off): the stream starts as the upstream's does."""
    pool = state.backends
    deadline = pool.outliers.first_token_timeout_s
    if pool.single or not deadline:
        return None
    events = aiter(relay)
    task = asyncio.ensure_future(anext(events, None))
    if not await _alive_past(state, task, deadline, [ctx.backend or ""]):
        await _cancelled(task)
        relay.failure = "no_first_token"
        return _Primed([], events)
    first = await task
    if first is None:
        return _Primed([], events)
    read = [first]
    if whole and relay.failure is None:
        read.extend([chunk async for chunk in events])
    return _Primed(read, events)


def _unusable_start(relay: SSERelay) -> str | None:
    """Why a stream's start is no answer (its backend's failure), or None."""
    if relay.failure == "no_first_token":
        return NO_FIRST_TOKEN
    # Whatever it relayed so far is still held here: nothing of this stream reached the client.
    return _UNUSABLE_STARTS.get(relay.failure) if relay.failure is not None else None


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """A JSON object's bytes with ``fields`` added at its end, the rest byte for byte as it came."""
    body = raw.rstrip()
    if not body.endswith(b"}"):
        return raw
    added = dumps(fields)[1:-1]
    inner = body[:-1].rstrip()
    separator = b"" if inner.endswith(b"{") else b","
    return inner + separator + added + b"}"


def _checked(state: ProxyState, ctx: RequestContext, raw: bytes, wire: Wire) -> tuple[dict[str, Any], Usage | None]:
    """A successful JSON answer's object and usage; 502 when it is not a JSON object, or lacks the
    protocol's answer list (it would otherwise reach the client as a success). Usage that cannot be
    true (see :mod:`proxy.openai.usage`) is no usage, counted."""
    try:
        parsed: Any = loads(raw)
    except ValueError:
        ctx.status = 502
        raise UpstreamProtocolError("its answer is not JSON") from None
    if not isinstance(parsed, dict):
        ctx.status = 502
        raise UpstreamProtocolError("its answer is not a JSON object")
    if wire.answer_list is not None and not isinstance(parsed.get(wire.answer_list), list):
        ctx.status = 502
        raise UpstreamProtocolError(f"its answer has no {wire.answer_list!r} list")
    reported = parsed.get("usage")
    usage = wire.read_usage(reported)
    if usage is not None and not usage.plausible:
        usage = None
    if usage is None and reported is not None:
        state.metrics.upstream_errors.labels(ctx.route, "invalid_usage").inc()
    return parsed, usage


def respond(
    state: ProxyState, ctx: RequestContext, answer: UpstreamAnswer, ending: AnswerEnding | None = None
) -> Response:
    """The client's response to ``answer``: the upstream's bytes unchanged (an error in the
    protocol's shape, without the credentials the proxy sent), the proxy's headers added."""
    if isinstance(answer, StreamingAnswer):
        return _relayed(state, ctx, answer, ending)
    if not answer.ok:
        return upstream_error(state, ctx, answer.status, answer.raw, answer.headers, ending)
    ctx.usage = answer.usage
    headers = {}
    if answer.usage is not None:
        headers["x-prefix-proxy-prompt-tokens"] = str(answer.usage.prompt_tokens)
        headers["x-prefix-proxy-cached-tokens"] = str(answer.usage.cached_tokens)
    return whole_answer(state, ctx, answer.raw, answer.status, headers, ending)


async def send_json(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    wire: Wire,
    payload: bytes | None,
    *,
    method: str = "POST",
) -> Response:
    """A whole exchange answered as it came (a route with nothing to record of its answer)."""
    return respond(state, ctx, await send(state, request, ctx, wire, payload, method=method))


def _relayed(state: ProxyState, ctx: RequestContext, answer: StreamingAnswer, ending: AnswerEnding | None) -> Response:
    """Each SSE event reaches the client as soon as it is complete."""
    relay = answer.relay
    told = False

    async def before_last_event() -> None:
        # The answer is whole: what the client's next request must find is recorded before the
        # client has the event that tells it so (it may ask at once, on another connection).
        nonlocal told
        told = True
        if ending is not None:
            ending.completed(answer)
            await ending.before_response()

    relay.before_last_event = before_last_event

    def ended(end: StreamEnd) -> None:
        ctx.upstream_done_at = time.perf_counter()
        ctx.usage = relay.usage
        if relay.first_event_at is not None:
            ctx.first_chunk_at = relay.first_event_at
            state.metrics.ttft.labels(state.metrics.model_label(ctx.model)).observe(ctx.first_chunk_at - ctx.started)
        if relay.usage_rejected:
            state.metrics.upstream_errors.labels(ctx.route, "invalid_usage").inc()
        if relay.failure in PROTOCOL_FAILURES:
            state.metrics.upstream_errors.labels(ctx.route, "invalid_response").inc()
        if relay.failure in _UNUSABLE_STARTS and end == "sent":
            # Broken mid-way (its start was fine): the backend's failure, though nothing can be retried.
            state.backends.answer_unusable(ctx.backend, _UNUSABLE_STARTS[relay.failure], ctx.model)
        # A disconnect noticed after the last event was relayed is just the client hanging up.
        if relay.completed:
            if ending is not None and not told:
                ending.completed(answer)
            return
        if end == "disconnected":
            state.metrics.streams_cancelled.inc()
            ctx.error_code = "client_disconnected"
        elif end == "deadline":
            state.metrics.upstream_errors.labels(ctx.route, "timeout").inc()
            ctx.error_code = "request_deadline_exceeded"
        else:
            state.metrics.streams_cancelled.inc()
            ctx.error_code = f"stream_{relay.failure or 'interrupted'}"
        if ending is not None:
            ending.cut_short(relay.usage, relay.events)

    headers = proxy_headers(ctx)
    headers["cache-control"] = "no-cache"
    headers["x-accel-buffering"] = "no"
    overhead = ctx.relay_start_overhead(time.perf_counter())
    headers.update(overhead_header(overhead))
    return RelayResponse(
        answer.body if answer.body is not None else relay,
        headers=headers,
        on_end=ended,
        close=relay.aclose,
        deadline_s=max(0.0, ctx.deadline - time.perf_counter()),
        deadline_event=ctx.dialect.stream_event("the request exceeded its deadline", "request_deadline_exceeded"),
        background=after_response(state, ctx, overhead, ending),
    )


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").lower().startswith("text/event-stream")


class within_deadline:
    """Bound the upstream work of a request by its overall deadline (``request_timeout_s``):
    per-read timeouts alone let an upstream that drips a byte at a time hold a request forever.

    A class over ``asyncio.timeout``, not an ``@asynccontextmanager``: no generator per request."""

    def __init__(self, ctx: RequestContext) -> None:
        self._timeout = asyncio.timeout(max(0.0, ctx.deadline - time.perf_counter()))

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            raise DeadlineExceeded() from None
        if isinstance(exc, TimeoutError):
            raise DeadlineExceeded() from None


def upstream_error(
    state: ProxyState,
    ctx: RequestContext,
    status: int,
    raw: bytes,
    headers: Mapping[str, str] | None = None,
    ending: AnswerEnding | None = None,
) -> Response:
    """An upstream's error answer, in the protocol's shape, without the credentials the proxy sent
    it (an error page may echo the request's Authorization); its ``Retry-After`` (a 429's, a 503's)
    goes to the client, whose retry should wait as the backend asked. A 401/403 is not the client's
    error (its key is the proxy's to check): :class:`UpstreamAuthFailed`."""
    if status in (401, 403):
        state.metrics.upstream_errors.labels(ctx.route, "auth_failed").inc()
        error = UpstreamAuthFailed(status, refused_credentials(state, ctx))
        ctx.status, ctx.error_code = error.status, error.code
        return whole_answer(state, ctx, json_bytes(ctx.dialect.body(error)), error.status, None, ending)
    state.metrics.upstream_errors.labels(ctx.route, "http_4xx" if status < 500 else "http_5xx").inc()
    ctx.status = status
    ctx.error_code = f"upstream_{status}"
    scrub = credential_scrubber(state, ctx)
    if scrub is not None:
        raw = scrub(raw)
    retry_after = headers.get("retry-after") if headers is not None else None
    extra = {"retry-after": retry_after} if retry_after and retry_after.isascii() and len(retry_after) < 64 else None
    return whole_answer(state, ctx, ctx.dialect.upstream_body(status, raw), status, extra, ending)


class UpstreamAuthFailed(UpstreamError):
    """502: the upstream refused (401/403) the credentials the proxy sent: its ``upstream_api_key``,
    a tenant's, none, or (an open proxy without a key) the client's, passed on. The client's key is
    the proxy's to check ("anything" will do on an open proxy): the proxy's configuration is at fault,
    so the client gets a server error saying so, never the upstream's 401 as if its own key were wrong."""

    code = "upstream_auth_failed"

    def __init__(self, status: int, refused: str) -> None:
        super().__init__(
            f"the upstream refused the proxy's credentials ({refused}; HTTP {status}): the proxy's operator "
            "must give it the key the upstream expects (upstream_api_key)"
        )


def refused_credentials(state: ProxyState, ctx: RequestContext) -> str:
    """What a 401/403 refused (proxy.backends.BackendPool.credentials decides what is sent)."""
    if ctx.upstream_api_key:
        return "the tenant's upstream_api_key"
    if any(backend.upstream.credentials for backend in state.backends.backends):
        return "its upstream_api_key"
    if not state.tenants.open:
        return "no key: upstream_api_key is not set"
    return "the client's key, passed on: upstream_api_key is not set"
