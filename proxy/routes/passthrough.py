"""Every other route the backend serves, passed through: tokenize, rerank, score, pooling, classify,
audio, version, and whatever vLLM adds later.

Bodies are not buffered: a JSON body (bounded by ``max_body_bytes``) is read to learn its model
(routing and metrics), anything else (multipart audio) streams to the backend as it arrives, and
the answer streams back as the backend sends it. Each request gets the caller's tenant, metrics
under the route's name and the overhead header, like the rest of the API. Routes that change or
expose the engine (``routes.admin_routes``: reset_prefix_cache, sleep, collective_rpc, weight
updates, LoRA loading...) need the admin key and reach the backend with the proxy's own key.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Literal
from urllib.parse import quote

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from proxy.app_state import ProxyState, get_state
from proxy.backends import Redactor
from proxy.config import HTTP_METHODS
from proxy.http import (
    MAX_MODEL_CHARS,
    PATH_SAFE,
    BodyTooDeep,
    ClientDisconnected,
    ClientError,
    InvalidPath,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    RelayResponse,
    RequestContext,
    RequestTimeout,
    StreamEnd,
    canonical_path,
    invalid_path,
    is_text,
    media_type_of,
    overhead_header,
    parsed_by_engines,
)
from proxy.openai import MAX_DEPTH, TooDeep, dumps, loads
from proxy.routes.admin import require_admin
from proxy.routes.exchange import upstream_error, within_deadline
from proxy.routes.forward import (
    REQUEST_ID_HEADER,
    after_response,
    authenticate,
    error_response,
    new_context,
    proxy_headers,
    sent_credentials,
    upstream_headers,
)

# Paths the proxy answers itself (or, for /metrics on its own port, must not answer): never
# forwarded, whatever the method.
RESERVED = ("/metrics", "/healthz", "/readyz", "/admin", "/v1/sessions", "/ui")

# vLLM 0.32's routes by metric label (docs/protocols.md); any other forwarded path counts as
# "other", so clients cannot grow the label set.
KNOWN_ROUTES = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/tokenizer_info": "tokenizer_info",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/score": "score",
    "/v1/score": "score",
    "/pooling": "pooling",
    "/classify": "classify",
    "/v2/embed": "embed",
    "/v1/audio/transcriptions": "audio_transcriptions",
    "/v1/audio/translations": "audio_translations",
    "/version": "version",
    "/health": "health",
    "/load": "load",
    "/ping": "ping",
    "/invocations": "invocations",
    "/generative_scoring": "generative_scoring",
    "/v1/chat/completions/batch": "chat_batch",
    "/v1/chat/completions/render": "render",
    "/v1/completions/render": "render",
    "/v1/messages/render": "render",
    "/v1/responses/render": "render",
    "/v1/chat/completions/derender": "render",
    "/v1/completions/derender": "render",
    "/inference/v1/generate": "generate_tokens",
    "/cohere/v2/chat": "cohere_chat",
}
_FORWARDED_RESPONSE_HEADERS = ("content-type", "content-encoding", "content-disposition")
_BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
# Set by PassthroughRoute on a request whose path is an owned route's in another letter case.
OWNED_SPELLING = "prefix_proxy.owned_spelling"


def matches(path: str, patterns: list[str], method: str | None = None) -> bool:
    """Whether ``path`` (asked with ``method``) matches a pattern, ASCII case aside: an upstream that
    matches routes case-insensitively must not be handed ``/Reset_Prefix_Cache`` as a tenant route.
    A pattern that starts with a method (``DELETE /models``) matches that method's requests only."""
    path = path.lower()
    for pattern in patterns:
        verb, _, route = pattern.partition(" ")
        if route and verb.upper() in HTTP_METHODS:
            asked = method.upper() if method is not None else None
            # A GET route answers HEAD too (as Starlette's and the engines' routers do).
            if asked != verb.upper() and not (asked == "HEAD" and verb.upper() == "GET"):
                continue
            pattern = route.strip()
        if fnmatch.fnmatchcase(path, pattern.rstrip("/").lower() or "/"):
            return True
    return False


def _governed(state: ProxyState) -> bool:
    """Whether tenants or budgets govern generation: routes outside the pipeline must not generate."""
    settings = state.settings
    budgets = settings.budget.tenant_tokens_per_window or settings.budget.session_tokens_per_window
    return not state.tenants.open or bool(budgets) or bool(settings.model_budgets)


def route_label(path: str, admin: bool) -> str:
    return "admin_passthrough" if admin else KNOWN_ROUTES.get(path, "other")


RouteDecision = Literal["admin", "forward", "not_found", "ungoverned", "unlisted"]


def route_decision(
    state: ProxyState, path: str, method: str | None = None, *, owned_spelling: bool = False
) -> RouteDecision:
    """What the pass-through does with a canonical ``path`` asked with ``method``: forward it for
    the admin (``admin``) or for a tenant (``forward``), or refuse it (404: ``not_found``, a
    generation route outside the pipeline ``ungoverned``, a route not known to be a tenant's
    ``unlisted``). One function for the route and for the property test that holds it to a
    Starlette router's reading."""
    settings = state.settings.routes
    admin = matches(path, settings.admin_routes, method)
    folded = path.lower()
    reserved = owned_spelling or any(folded == r or folded.startswith(r + "/") for r in RESERVED)
    allowed = settings.allowed_routes is None or admin or matches(path, settings.allowed_routes, method)
    if reserved or not settings.passthrough or not allowed or matches(path, settings.denied_routes, method):
        return "not_found"
    if admin:
        return "admin"
    if settings.allowed_routes is not None or not _governed(state):
        # An open proxy forwards what the engine serves; allowed_routes is the operator's own list.
        return "forward"
    if matches(path, settings.ungoverned_generation, method):
        return "ungoverned"
    return "forward" if matches(path, settings.tenant_routes, method) else "unlisted"


async def passthrough(request: Request) -> Response:
    state = get_state(request)
    path: str | None
    try:
        # Canonical already (proxy.app makes every path so before routing); checked again here
        # so that this route can never forward another spelling, whatever app it is mounted in.
        path = canonical_path(request.scope["path"])
    except InvalidPath:
        path = None
    decision = (
        route_decision(state, path, request.method, owned_spelling=request.scope.get(OWNED_SPELLING, False))
        if path is not None
        else "not_found"
    )
    admin = decision == "admin"
    ctx = new_context(request, route_label(path or "", admin))
    ctx.deadline = ctx.started + state.settings.request_timeout_s
    if state.tracing is not None:
        state.tracing.start(request, ctx)
    try:
        if path is None:
            raise invalid_path()
        if decision == "not_found":
            raise NotFound(f"no route {path}")
        if decision == "ungoverned":
            raise NotFound(
                f"{path} generates outside the proxy's pipeline (no budget, no cache salt): use "
                "/v1/chat/completions or /v1/completions, or list it in routes.allowed_routes"
            )
        if decision == "unlisted":
            raise NotFound(
                f"no route {path} for tenants: the proxy forwards only the engine routes known not to "
                "generate nor change the engine (routes.tenant_routes); list it in routes.allowed_routes"
            )
        if admin:
            require_admin(state, request)
            ctx.tenant = "admin"
        else:
            await authenticate(state, request, ctx)
        return await forward_raw(state, request, ctx, path, admin=admin)
    except ProxyError as error:
        return error_response(state, ctx, error)


async def forward_raw(
    state: ProxyState,
    request: Request,
    ctx: RequestContext,
    path: str,
    *,
    admin: bool = False,
    backend: str | None = None,
) -> Response:
    """Forward ``request`` to ``path`` (``/v1/...`` under the API base, anything else at the server
    root), its body streamed or (JSON) read for its model, the answer streamed back."""
    body, replayable, upload = await _request_body(state, request, ctx, admin=admin)
    headers = (
        {REQUEST_ID_HEADER: ctx.request_id, **state.backends.credentials(None)}
        if admin
        else {k: v for k, v in upstream_headers(state, request, ctx).items() if k != "content-type"}
    )
    if admin and state.tracing is not None:
        state.tracing.inject(ctx, headers)
    for name in ("content-type", "accept"):
        if (value := request.headers.get(name)) is not None and value.isascii():
            headers[name] = value
    under_api = path.startswith("/v1/")
    # Sent as the upstream will decode it to the path matched here (a %00 or a space included).
    target = quote(path[3:] if under_api else path, safe=PATH_SAFE)
    if request.url.query:
        target += "?" + request.url.query
    ctx.mark_upstream_sent()
    try:
        async with within_deadline(ctx):
            response = await state.backends.open(
                request.method,
                target,
                content=body,
                headers=headers,
                root=not under_api,
                key=ctx.route_key,
                model=ctx.model,
                pinned_to=backend,
                replayable=replayable,
            )
    except ProxyError:
        if upload is not None and upload.failure is not None:
            raise upload.failure from None
        raise
    ctx.backend = response.extensions.get("prefix_proxy_backend")
    ctx.upstream_headers_at = time.perf_counter()
    ctx.status = response.status_code
    if response.status_code >= 400:
        async with within_deadline(ctx):
            raw = await state.backends.read(response)
        ctx.upstream_done_at = time.perf_counter()
        return upstream_error(state, ctx, response.status_code, raw, response.headers)
    return _streamed(state, ctx, response)


class _Upload:
    """The client's body on its way upstream, bounded, without buffering it."""

    def __init__(self, request: Request, limit: int) -> None:
        self._request = request
        self._limit = limit
        self.failure: ClientError | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        try:
            async for chunk in self._request.stream():
                size += len(chunk)
                if size > self._limit:
                    self.failure = PayloadTooLarge(self._limit)
                    raise self.failure
                yield chunk
        except ClientDisconnect:
            self.failure = ClientDisconnected()
            raise self.failure from None
        except RequestTimeout as timeout:
            self.failure = timeout  # the body's read deadline (proxy.http.inbound): the client's 408
            raise


async def _request_body(
    state: ProxyState, request: Request, ctx: RequestContext, *, admin: bool = False
) -> tuple[bytes | _Upload | None, bool, _Upload | None]:
    """(body, replayable, upload): a JSON body read (for its model; a tenant's without the fields
    that are the deployment's), anything else streamed."""
    limit = state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    if request.method in _BODYLESS and declared in (None, "0") and "transfer-encoding" not in request.headers:
        return None, True, None
    # What an engine parses as JSON is read whole: the depth limit holds for it and its model routes it.
    if not parsed_by_engines(media_type_of(request)):
        upload = _Upload(request, limit)
        return upload, False, upload
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    raw = b"".join(chunks)
    try:
        parsed = loads(raw, max_depth=MAX_DEPTH) if raw else None
    except TooDeep:
        # As on the proxy's own routes: no backend needs it, and a parser may not survive it.
        raise BodyTooDeep(MAX_DEPTH) from None
    except (ValueError, UnicodeDecodeError):
        parsed = None  # the backend judges its own input
    model = parsed.get("model") if isinstance(parsed, dict) else None
    if isinstance(model, str) and model and len(model) <= MAX_MODEL_CHARS and is_text(model):
        ctx.model = model
    if not admin and (kept := state.tenants.without_deployment_fields(parsed)) is not parsed:
        raw = dumps(kept)
    return raw, True, None


def _streamed(state: ProxyState, ctx: RequestContext, response: httpx.Response) -> Response:
    headers = proxy_headers(ctx)
    headers["content-type"] = "application/octet-stream"  # unless the backend says what it is
    for name in _FORWARDED_RESPONSE_HEADERS:
        if (value := response.headers.get(name)) is not None:
            headers[name] = value
    event_stream = response.headers.get("content-type", "").startswith("text/event-stream")
    ctx.stream = event_stream
    overhead = ctx.relay_start_overhead(time.perf_counter())
    headers.update(overhead_header(overhead))

    credentials = sent_credentials(state, ctx)
    encoded = response.headers.get("content-encoding", "identity").lower() not in ("", "identity")

    async def body() -> AsyncIterator[bytes]:
        chunks: AsyncIterator[bytes] = response.aiter_raw()
        if credentials and not encoded:
            # An answer is the backend's to write, a debug echo of the request's headers included:
            # the credentials the proxy sent are not relayed (an encoded body cannot be read here).
            chunks = Redactor(credentials).stream(chunks)
        try:
            async for chunk in chunks:
                yield chunk
        except (httpx.TransportError, httpx.TimeoutException):
            # Headers are out: the answer can only stop short; the access log says why.
            ctx.error_code = "upstream_stream_interrupted"
        finally:
            await response.aclose()

    def on_end(end: StreamEnd) -> None:
        ctx.upstream_done_at = time.perf_counter()
        if end != "sent":
            ctx.error_code = "client_disconnected" if end == "disconnected" else "request_deadline_exceeded"

    deadline_event = (
        ctx.dialect.stream_event("the request exceeded its deadline", "request_deadline_exceeded")
        if event_stream
        else b""
    )
    return RelayResponse(
        body(),
        headers=headers,
        on_end=on_end,
        close=response.aclose,
        status_code=response.status_code,
        deadline_s=max(0.0, ctx.deadline - time.perf_counter()),
        deadline_event=deadline_event,
        background=after_response(state, ctx, overhead),
    )


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class PassthroughRoute(Route):
    """Matches every path but those of the proxy's own routes: a wrong method on those is the
    proxy's 405 (with ``Allow``), not a request for the backend."""

    def __init__(self, owned: Sequence[BaseRoute]) -> None:
        super().__init__("/{path:path}", passthrough, methods=METHODS)
        self._owned = [r for r in owned if isinstance(r, Route)]
        self._owned_folded = [re.compile(r.path_regex.pattern, re.IGNORECASE) for r in self._owned]

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return super().matches(scope)
        path = scope["path"]
        if any(r.path_regex.match(path) for r in self._owned):
            return Match.NONE, {}
        match, child = super().matches(scope)
        if match is not Match.NONE and any(r.match(path) for r in self._owned_folded):
            # An owned route in other letters: never forwarded (the proxy's 404), since an upstream
            # that matches case-insensitively would serve it past that route's pipeline.
            child[OWNED_SPELLING] = True
        return match, child


def routes(owned: Sequence[BaseRoute]) -> list[BaseRoute]:
    """The pass-through route, to be placed after ``owned`` (the app's own routes)."""
    return [PassthroughRoute(owned)]
