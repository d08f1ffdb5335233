"""The forwarded API's edge: an endpoint's request context and tenant, the proxy's headers on
every response, and the one step after every response (the answer's ending, then metrics and the
access line). The exchange with the upstream itself is ``proxy.routes.exchange``'s."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState, get_state
from proxy.backends import Redactor, key_forms, upstream_error_kind
from proxy.http import OPENAI, ErrorDialect, ProxyError, RequestContext, UpstreamError, json_bytes, overhead_header
from proxy.ids import unique_id
from proxy.observability import log_request
from proxy.openai import Usage
from proxy.tenants import Tenant

REQUEST_ID_HEADER = "x-request-id"


def new_context(request: Request, route: str) -> RequestContext:
    ctx = RequestContext(route=route)
    incoming = request.headers.get(REQUEST_ID_HEADER)
    # Sent upstream as a header again: printable ASCII only (a header may carry any byte, which
    # httpx would refuse to send).
    if incoming and len(incoming) <= 128 and incoming.isascii() and incoming.isprintable():
        ctx.request_id, ctx.client_named = incoming, True
    return ctx


def engine_request_id(state: ProxyState, ctx: RequestContext) -> str:
    """The ``X-Request-Id`` sent upstream: the client's own where the proxy is open (a drop-in), the
    proxy's where tenants share the engine (vLLM runs a request under that id, and takes the body's
    ``request_id`` for it, which tenants may not set either: :data:`proxy.tenants.DEPLOYMENT_FIELDS`)."""
    if state.tenants.open or not ctx.client_named:
        return ctx.request_id
    if ctx.engine_request_id is None:
        ctx.engine_request_id = unique_id()  # the access log records it beside the client's
    return ctx.engine_request_id


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
        # Answers are relayed as they come, read on the way (a stream's events, its usage): an encoded
        # one (an intermediary compressing text/*) would be neither read nor decodable by the relay.
        "accept-encoding": "identity",
        REQUEST_ID_HEADER: engine_request_id(state, ctx),
        **state.backends.credentials(ctx.upstream_api_key, passed_on),
    }
    if state.tracing is not None:
        state.tracing.inject(ctx, headers)
    return headers


def sent_credentials(state: ProxyState, ctx: RequestContext) -> list[str]:
    """The credentials the proxy itself sends upstream (its upstream key, a tenant's, a URL's user
    and password): never to be relayed back to a client."""
    credentials = [c for backend in state.backends.backends for c in backend.upstream.credentials]
    credentials.extend(key_forms(ctx.upstream_api_key))
    return credentials


def credential_scrubber(state: ProxyState, ctx: RequestContext) -> Callable[[bytes], bytes] | None:
    """What removes the credentials the proxy itself sent upstream (its upstream key, a tenant's,
    a URL's user and password) from what the upstream answers; None when it sent none. Built on
    first use: most answers carry no error to scrub. The client's own credentials, passed on by an
    open proxy, are the client's to see."""
    credentials = sent_credentials(state, ctx)
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
    state: ProxyState,
    ctx: RequestContext,
    content: bytes,
    status: int,
    headers: Mapping[str, str] | None = None,
    ending: AnswerEnding | None = None,
) -> Response:
    """A whole (not streamed) JSON answer with the proxy's headers, overhead included; what comes
    after it is :func:`after_response`'s."""
    overhead = ctx.overhead_seconds()
    all_headers = {**headers} if headers else {}
    all_headers.update(proxy_headers(ctx))
    all_headers.update(overhead_header(overhead))
    return Response(
        content,
        status,
        headers=all_headers,
        media_type="application/json",
        background=after_response(state, ctx, overhead, ending),
    )


class AnswerEnding(Protocol):
    """What an answer means beyond its bytes (a session's turn, a budget): told how the answer
    ended (``proxy.routes.exchange``), it records that first after the response is sent."""

    def completed(self, answer: Any) -> None: ...

    def cut_short(self, usage: Usage | None, events: int) -> None: ...

    def failed(self, error: ProxyError | None) -> None: ...

    async def before_response(self) -> None:
        """What must be recorded before the client has the whole answer (a stream's last event):
        the client may act on it at once."""

    async def record(self) -> None: ...


def after_response(
    state: ProxyState, ctx: RequestContext, overhead: float, ending: AnswerEnding | None = None
) -> AfterSending:
    """The one step after every response, whole or streamed, answer or error: the ending's record,
    then the metrics and the access line, in that order.

    Not on the client's time. For a whole answer it runs inline after the body (no await in
    between for the in-process store), so nothing the proxy serves next (a scrape of ``/metrics``,
    the conversation's next turn) can come before it."""

    def accounted() -> None:
        account(state, ctx, overhead)

    if ending is None:
        return AfterSending(accounted)
    return AfterSending(ending.record, accounted)


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


def error_response(
    state: ProxyState, ctx: RequestContext, error: ProxyError, ending: AnswerEnding | None = None
) -> Response:
    ctx.status = error.status
    ctx.error_code = error.code or error.type
    if ctx.upstream_sent_at is not None and ctx.upstream_done_at is None:
        # Waiting for an upstream that failed (timeout, connection refused) is upstream time, not overhead.
        ctx.upstream_done_at = time.perf_counter()
    if isinstance(error, UpstreamError):
        state.metrics.upstream_errors.labels(ctx.route, upstream_error_kind(error)).inc()
    return whole_answer(state, ctx, json_bytes(ctx.dialect.body(error)), error.status, error.headers, ending)
