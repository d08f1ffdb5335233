"""Sending a request upstream and turning the answer into the client's response."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState, get_state
from proxy.backends.pool import BACKEND_EXTENSION
from proxy.backends.upstream import Redactor, key_forms, upstream_error_kind
from proxy.http.context import RequestContext, overhead_header
from proxy.http.dialect import OPENAI, ErrorDialect
from proxy.http.errors import DeadlineExceeded, ProxyError, UpstreamError, UpstreamProtocolError, json_bytes
from proxy.http.relay import PROTOCOL_FAILURES, SSERelay
from proxy.http.streaming import RelayResponse, StreamEnd
from proxy.observability.access_log import log_request
from proxy.openai.jsonio import loads
from proxy.openai.usage import Usage
from proxy.tenants import Tenant

REQUEST_ID_HEADER = "x-request-id"
# How a protocol's ``usage`` object reads (chat completions' by default).
UsageReader = Callable[[Any], Usage | None]
# The list a successful whole answer of each protocol holds (its choices, content blocks, output
# items): an answer without it is no answer, however it is labelled.
ANSWER_LISTS = {
    "/chat/completions": "choices",
    "/completions": "choices",
    "/messages": "content",
    "/responses": "output",
}


def new_context(request: Request, route: str) -> RequestContext:
    ctx = RequestContext(route=route)
    incoming = request.headers.get(REQUEST_ID_HEADER)
    # Sent upstream as a header again: printable ASCII only (a header may carry any byte, which
    # httpx would refuse to send).
    if incoming and len(incoming) <= 128 and incoming.isascii() and incoming.isprintable():
        ctx.request_id = incoming
    return ctx


def client_authorization(request: Request) -> str | None:
    """The caller's credentials: ``Authorization``, or Anthropic's ``x-api-key`` (its SDKs send only
    that) as the bearer token it stands for."""
    authorization = request.headers.get("authorization")
    if authorization is None and (api_key := request.headers.get("x-api-key")):
        authorization = f"Bearer {api_key}"
    return authorization


async def authenticate(state: ProxyState, request: Request, ctx: RequestContext) -> Tenant:
    """The caller's tenant (401 when keys are configured and none matches), recorded on ``ctx``."""
    tenant = await state.tenants.authenticate(client_authorization(request))
    ctx.tenant = tenant.name
    ctx.upstream_api_key = tenant.upstream_api_key
    return tenant


Handler = Callable[[ProxyState, Request, RequestContext, Tenant], Awaitable[Response]]


def api_endpoint(
    route: str, handler: Handler, dialect: ErrorDialect = OPENAI
) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint of the forwarded API: ``handler`` gets a request context and the caller's tenant,
    and any :class:`ProxyError` it raises is answered (and counted) in the protocol's error shape."""

    async def endpoint(request: Request) -> Response:
        state = get_state(request)
        ctx = new_context(request, route)
        ctx.dialect = dialect
        ctx.deadline = ctx.started + state.settings.request_timeout_s
        if state.tracing is not None:
            state.tracing.start(request, ctx)
        try:
            tenant = await authenticate(state, request, ctx)
            return await handler(state, request, ctx, tenant)
        except ProxyError as error:
            return error_response(state, ctx, error)

    return endpoint


def upstream_headers(state: ProxyState, request: Request, ctx: RequestContext) -> dict[str, str]:
    # Only an open proxy passes the client's credentials on: otherwise they carry its proxy key,
    # which the upstream must never see.
    passed_on = client_authorization(request) if state.tenants.open else None
    headers = {
        "content-type": "application/json",
        REQUEST_ID_HEADER: ctx.request_id,
        **state.backends.credentials(ctx.upstream_api_key, passed_on),
    }
    if state.tracing is not None:
        state.tracing.inject(ctx, headers)
    return headers


def credential_scrubber(state: ProxyState, ctx: RequestContext) -> Callable[[bytes], bytes] | None:
    """What removes the credentials the proxy itself sent upstream (its upstream key, a tenant's,
    a URL's user and password) from what the upstream answers; None when it sent none. Built on
    first use: most answers carry no error to scrub. The client's own credentials, passed on by an
    open proxy, are the client's to see."""
    credentials = [c for backend in state.backends.backends for c in backend.upstream.credentials]
    credentials.extend(key_forms(ctx.upstream_api_key))
    if not credentials:
        return None
    redactor: Redactor | None = None

    def scrub(raw: bytes) -> bytes:
        nonlocal redactor
        if redactor is None:
            redactor = Redactor(credentials)
        return redactor(raw)

    return scrub


def proxy_headers(ctx: RequestContext) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: ctx.request_id}
    if ctx.actions:
        headers["x-prefix-proxy-actions"] = ",".join(ctx.actions)[:4000]
    if ctx.prefix_hash:
        headers["x-prefix-proxy-prefix"] = ctx.prefix_hash
    if ctx.session_id:
        headers["x-prefix-proxy-session"] = ctx.session_id
    if ctx.cache_break is not None:
        ctx.cache_break.settle(ctx.usage)
        headers["x-prefix-proxy-cache-break"] = ctx.cache_break.header()
    return headers


def account(state: ProxyState, ctx: RequestContext, overhead: float | None = None) -> float:
    """Record metrics and the access-log line of an answered request; returns the proxy overhead in
    seconds."""
    if overhead is None:
        overhead = ctx.overhead_seconds()
    metrics = state.metrics
    if ctx.status < 400 and ctx.upstream_sent_at is not None:
        metrics.confirm_model(ctx.model)
    metrics.record_request(ctx.route, ctx.status, ctx.model, ctx.tenant)
    metrics.overhead.labels(ctx.route).observe(overhead)
    upstream = ctx.upstream_seconds()
    if upstream is not None:
        metrics.upstream_latency.labels(ctx.route).observe(upstream)
    if ctx.usage is not None:
        metrics.record_usage(ctx.model or "", ctx.tenant, ctx.usage)
        if ctx.saved_by_canonicalization and ctx.usage.cached_tokens:
            metrics.record_saved(ctx.model or "", ctx.tenant, "canonicalization", ctx.usage.cached_tokens)
        if ctx.cache_break is not None and ctx.status < 400:
            ctx.cache_break.settle(ctx.usage)
            state.cache_breaks.count(ctx.cache_break)
    log_request(ctx, overhead * 1000)
    if state.tracing is not None:
        state.tracing.end(ctx, overhead)
    return overhead


def whole_answer(
    state: ProxyState, ctx: RequestContext, content: bytes, status: int, headers: Mapping[str, str] | None = None
) -> Response:
    """A whole (not streamed) JSON answer with the proxy's headers, overhead included.

    Its metrics and access-log line are recorded once it is sent: not on the client's time. They
    run inline after the body (no await in between), so nothing the proxy serves next (a scrape
    of ``/metrics``, the conversation's next turn) can come before them.
    """
    overhead = ctx.overhead_seconds()
    all_headers = {**headers} if headers else {}
    all_headers.update(proxy_headers(ctx))
    all_headers.update(overhead_header(overhead))

    def record() -> None:
        account(state, ctx, overhead)

    return Response(
        content, status, headers=all_headers, media_type="application/json", background=AfterSending(record)
    )


class AfterSending(BackgroundTask):
    """What runs once a response is sent, in order (Starlette awaits ``response.background()``).

    Each step runs even if one before it failed (the accounting of an answer must not be lost to
    a failed session write); the first failure is raised at the end. Lighter than the
    ``BackgroundTask`` it stands for, which inspects its function on every construction.
    """

    def __init__(self, *steps: Callable[[], Awaitable[None] | None]) -> None:
        # BackgroundTask's own fields stay unset: only its __call__, replaced here, reads them.
        self.steps = list(steps)

    async def __call__(self) -> None:
        failure: BaseException | None = None
        for step in self.steps:
            try:
                result = step()
                if result is not None:
                    await result
            except BaseException as exc:  # raised below, once the other steps have run
                failure = failure or exc
        if failure is not None:
            raise failure


def after_sending(response: Response, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` once ``response`` is sent, ahead of its accounting (see :func:`whole_answer`)."""
    then = response.background
    if isinstance(then, AfterSending):
        then.steps.insert(0, work)
    else:
        steps: list[Callable[[], Awaitable[None] | None]] = [work]
        if then is not None:
            steps.append(then)
        response.background = AfterSending(*steps)


def error_response(state: ProxyState, ctx: RequestContext, error: ProxyError) -> Response:
    ctx.status = error.status
    ctx.error_code = error.code or error.type
    if ctx.upstream_sent_at is not None and ctx.upstream_done_at is None:
        # Waiting for an upstream that failed (timeout, connection refused) is upstream time, not overhead.
        ctx.upstream_done_at = time.perf_counter()
    if isinstance(error, UpstreamError):
        state.metrics.upstream_errors.labels(ctx.route, upstream_error_kind(error)).inc()
    return whole_answer(state, ctx, json_bytes(ctx.dialect.body(error)), error.status, error.headers)


async def send_json(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    path: str,
    payload: bytes | None,
    *,
    on_reply: Callable[[dict[str, Any]], None] | None = None,
    method: str = "POST",
    read_usage: UsageReader = Usage.from_openai,
    backend: str | None = None,
) -> Response:
    """Forward a non-streaming request; the upstream's bytes reach the client unchanged.
    ``backend``: only that backend may answer (it holds state the request refers to)."""
    async with within_deadline(ctx):
        response = await open_upstream(state, request, ctx, method, path, payload, backend=backend)
        ctx.upstream_headers_at = time.perf_counter()
        raw = await state.backends.read(response)
    ctx.upstream_done_at = time.perf_counter()
    ctx.status = response.status_code
    if response.status_code >= 400:
        return upstream_error(state, ctx, response.status_code, raw, response.headers)
    return json_answer(state, ctx, response.status_code, raw, on_reply, read_usage, ANSWER_LISTS.get(path))


def json_answer(
    state: ProxyState,
    ctx: RequestContext,
    status: int,
    raw: bytes,
    on_reply: Callable[[dict[str, Any]], None] | None = None,
    read_usage: UsageReader = Usage.from_openai,
    answer_list: str | None = None,
) -> Response:
    """The upstream's successful JSON answer, bytes unchanged; 502 when it is not a JSON object, or
    lacks the protocol's ``answer_list`` (it would otherwise reach the client as a success).

    Usage that cannot be true (see :mod:`proxy.openai.usage`) is no usage: None, counted."""
    try:
        parsed: Any = loads(raw)
    except ValueError:
        ctx.status = 502
        raise UpstreamProtocolError("its answer is not JSON") from None
    if not isinstance(parsed, dict):
        ctx.status = 502
        raise UpstreamProtocolError("its answer is not a JSON object")
    if answer_list is not None and not isinstance(parsed.get(answer_list), list):
        ctx.status = 502
        raise UpstreamProtocolError(f"its answer has no {answer_list!r} list")
    reported = parsed.get("usage")
    usage = read_usage(reported)
    if usage is not None and not usage.plausible:
        usage = None
    if usage is None and reported is not None:
        state.metrics.upstream_errors.labels(ctx.route, "invalid_usage").inc()
    ctx.usage = usage
    if on_reply is not None:
        on_reply(parsed)
    headers = {}
    if ctx.usage is not None:
        headers["x-prefix-proxy-prompt-tokens"] = str(ctx.usage.prompt_tokens)
        headers["x-prefix-proxy-cached-tokens"] = str(ctx.usage.cached_tokens)
    return whole_answer(state, ctx, raw, status, headers)


async def send_stream(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    path: str,
    payload: bytes,
    *,
    client_wants_usage: bool,
    on_complete: Callable[[SSERelay], None] | None = None,
    on_incomplete: Callable[[SSERelay], None] | None = None,
    record_content: bool = False,
    on_reply: Callable[[dict[str, Any]], None] | None = None,
    relay_class: Callable[..., SSERelay] = SSERelay,
    read_usage: UsageReader = Usage.from_openai,
    backend: str | None = None,
) -> Response:
    """Forward a streaming request; each SSE event reaches the client as soon as it is complete.
    ``relay_class`` reads the protocol's events (chat completions' by default)."""
    async with within_deadline(ctx):
        response = await open_upstream(state, request, ctx, "POST", path, payload, backend=backend)
        ctx.upstream_headers_at = time.perf_counter()
        ctx.status = response.status_code
        if response.status_code >= 400 or not _is_event_stream(response):
            # An error, or an upstream that answered a stream request with one JSON body (some
            # servers ignore "stream"): that body, labelled for what it is.
            raw = await state.backends.read(response)
            ctx.upstream_done_at = time.perf_counter()
            if response.status_code >= 400:
                return upstream_error(state, ctx, response.status_code, raw, response.headers)
            ctx.stream = False
            return json_answer(state, ctx, response.status_code, raw, on_reply, read_usage, ANSWER_LISTS.get(path))

    def first_chunk() -> None:
        ctx.first_chunk_at = time.perf_counter()
        state.metrics.ttft.labels(state.metrics.model_label(ctx.model)).observe(ctx.first_chunk_at - ctx.started)

    relay = relay_class(
        response,
        client_wants_usage=client_wants_usage,
        on_first_chunk=first_chunk,
        record_content=record_content,
        max_event_bytes=state.settings.max_sse_event_bytes,
        dialect=ctx.dialect,
        scrub=credential_scrubber(state, ctx),
    )

    def on_end(end: StreamEnd) -> None:
        ctx.upstream_done_at = time.perf_counter()
        ctx.usage = relay.usage
        if relay.usage_rejected:
            state.metrics.upstream_errors.labels(ctx.route, "invalid_usage").inc()
        if relay.failure in PROTOCOL_FAILURES:
            state.metrics.upstream_errors.labels(ctx.route, "invalid_response").inc()
        # A disconnect noticed after the last event was relayed is just the client hanging up.
        if not relay.completed:
            if end == "disconnected":
                state.metrics.streams_cancelled.inc()
                ctx.error_code = "client_disconnected"
            elif end == "deadline":
                state.metrics.upstream_errors.labels(ctx.route, "timeout").inc()
                ctx.error_code = "request_deadline_exceeded"
            else:
                state.metrics.streams_cancelled.inc()
                ctx.error_code = f"stream_{relay.failure or 'interrupted'}"
            if on_incomplete is not None:
                on_incomplete(relay)
        elif on_complete is not None:
            on_complete(relay)
        account(state, ctx, ctx.relay_start_overhead(headers_ready))

    headers = proxy_headers(ctx)
    headers["cache-control"] = "no-cache"
    headers["x-accel-buffering"] = "no"
    headers_ready = time.perf_counter()
    headers.update(overhead_header(ctx.relay_start_overhead(headers_ready)))
    return RelayResponse(
        relay,
        headers=headers,
        on_end=on_end,
        close=relay.aclose,
        deadline_s=max(0.0, ctx.deadline - time.perf_counter()),
        deadline_event=ctx.dialect.stream_event("the request exceeded its deadline", "request_deadline_exceeded"),
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


async def open_upstream(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    method: str,
    path: str,
    payload: bytes | None,
    *,
    backend: str | None = None,
) -> httpx.Response:
    ctx.mark_upstream_sent()
    response = await state.backends.open(
        method,
        path,
        content=payload,
        headers=upstream_headers(state, request, ctx),
        key=ctx.route_key,
        model=ctx.model,
        pinned_to=backend,
    )
    ctx.backend = response.extensions.get(BACKEND_EXTENSION)
    return response


def upstream_error(
    state: ProxyState, ctx: RequestContext, status: int, raw: bytes, headers: Mapping[str, str] | None = None
) -> Response:
    """An upstream's error answer, in the protocol's shape, without the credentials the proxy sent
    it (an error page may echo the request's Authorization); its ``Retry-After`` (a 429's, a 503's)
    goes to the client, whose retry should wait as the backend asked."""
    state.metrics.upstream_errors.labels(ctx.route, "http_4xx" if status < 500 else "http_5xx").inc()
    ctx.error_code = f"upstream_{status}"
    scrub = credential_scrubber(state, ctx)
    if scrub is not None:
        raw = scrub(raw)
    retry_after = headers.get("retry-after") if headers is not None else None
    extra = {"retry-after": retry_after} if retry_after and retry_after.isascii() and len(retry_after) < 64 else None
    return whole_answer(state, ctx, ctx.dialect.upstream_body(status, raw), status, extra)


def with_upstream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body asking the upstream for the usage chunk, and whether the client asked for it itself."""
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True}}, bool(options.get("include_usage"))
