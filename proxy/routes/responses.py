"""OpenAI Responses: ``POST /v1/responses`` through the pipeline, stored responses where they live.

vLLM keeps stored responses (``store``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in its own
process, so a ``previous_response_id`` chain can only continue on the backend that answered its
last turn. The proxy remembers, per tenant and in the session store (shared by replicas), which
backend holds each response it relayed and which chain it belongs to; a chain is one session
(its root response names it), pinned to that backend. A response another tenant created is not
found; one the proxy does not know of (relayed before a restart with the in-memory store) is
looked for on each backend, when the proxy is open.

A chain's history is the backend's, not in the request: the view holds the new turn only, so
canonicalization covers instructions, tools and the new input, the context budget counts the
previous turn's tokens, and no summary is anchored (the summarizer folds stateless Responses
conversations, those that re-send their whole input).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import xxhash
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.http import RESPONSES_API, ProxyError, RequestContext, ResponseNotFound, ServiceUnavailable
from proxy.protocols import RESPONSES, responses
from proxy.routes import compaction
from proxy.routes.forward import api_endpoint, upstream_headers
from proxy.routes.passthrough import forward_raw
from proxy.routes.pipeline import TurnOptions, forward_turn
from proxy.sessions import StoreUnavailable
from proxy.tenants import Tenant

# vLLM's ids are resp_<hex>; anything else is not one (and must not reach a URL unescaped).
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")


async def create(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = await compaction.read_responses(state, request, ctx, tenant)  # compaction items expanded
    if isinstance(body, Response):
        return body  # a compaction, answered by the proxy's summarizer (docs/compaction.md)
    compacted = await compaction.past_threshold(state, request, ctx, tenant, RESPONSES, body)
    if isinstance(compacted, Response):
        return compacted
    body, diagnostics = RESPONSES.diagnostics_asked(compacted.body)
    view = RESPONSES.view(body, state.canonicalizer.tool_orders, tenant.name)
    options = TurnOptions(diagnostics=diagnostics)
    chain: str | None = None
    previous = view.previous_response_id
    if previous is not None and not _RESPONSE_ID.fullmatch(previous):
        raise ResponseNotFound(previous[:64], "previous_response_id")
    if previous is not None:
        info = await _lookup(state, tenant, previous)
        if info is None and not state.tenants.open:
            raise ResponseNotFound(previous, "previous_response_id")
        chain = str(info.get("chain") or previous) if info else previous
        options.backend = str(info["backend"]) if info and info.get("backend") else None
        if info is None:
            options.backend = await _locate(state, request, ctx, previous)
        options.history_tokens = int(info.get("tokens") or 0) if info else 0
        options.summarize = False
        # The chain is the session its first response opened, whatever else the client sends.
        session = info.get("session") if info else None
        options.session_id = str(session) if session else _chain_session(chain)
    if body.get("store") is not False:

        async def remember(answer: dict[str, Any], backend: str | None) -> None:
            await _remember(state, tenant, answer, backend, chain, ctx.session_id)

        options.on_answer = remember
    return compacted.deliver(await forward_turn(state, request, ctx, tenant, RESPONSES, view, options))


async def retrieve(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    """A stored response (``GET`` or ``DELETE /v1/responses/{id}``, ``POST .../cancel``, ``GET
    .../input_items`` and whatever else vLLM serves under it): from the backend holding it, and only
    for the tenant that created it."""
    response_id = str(request.path_params["response_id"])
    if not _RESPONSE_ID.fullmatch(response_id):
        raise ResponseNotFound(response_id[:64], "response_id")
    info = await _lookup(state, tenant, response_id)
    if info is None and not state.tenants.open:
        raise ResponseNotFound(response_id, "response_id")
    backend = str(info["backend"]) if info and info.get("backend") else None
    if backend is None:
        backend = await _locate(state, request, ctx, response_id)
    return await forward_raw(state, request, ctx, request.scope["path"], backend=backend)


async def _lookup(state: ProxyState, tenant: Tenant, response_id: str) -> dict[str, Any] | None:
    """What the store records of ``tenant``'s stored response, or None. The store down: with tenants,
    503 (which tenant a response belongs to is the store's to say: another replica's responses cannot
    be told apart from another tenant's meanwhile, docs/sessions.md); without, None (one tenant:
    every backend holding it may answer, :func:`_locate`)."""
    try:
        return await state.sessions.get_response(tenant.name, response_id)
    except StoreUnavailable:
        if state.tenants.open:
            return None
        raise ServiceUnavailable(
            "the session store is unavailable: a stored response is served only to the tenant that made "
            "it, which the store records; retry once it is back"
        ) from None


def _chain_session(chain: str) -> str:
    """The session of a chain whose opening the proxy did not see (its record is gone)."""
    return "r" + xxhash.xxh3_128_hexdigest(chain.encode())[:31]


async def _remember(
    state: ProxyState,
    tenant: Tenant,
    answer: dict[str, Any],
    backend: str | None,
    chain: str | None,
    session: str | None,
) -> None:
    response_id = answer.get("id")
    if not isinstance(response_id, str) or not response_id:
        return
    usage = responses.read_usage(answer.get("usage"))
    info = {
        "backend": backend,
        "chain": chain or response_id,
        "session": session,
        "tokens": usage.total_tokens if usage else 0,
    }
    with contextlib.suppress(StoreUnavailable):
        await state.sessions.put_response(tenant.name, response_id, info, state.settings.responses.chain_ttl_s)


async def _locate(state: ProxyState, request: Request, ctx: RequestContext, response_id: str) -> str | None:
    """The backend holding a response the proxy has no record of: the first that finds it."""
    pool = state.backends
    if pool.single:
        return None
    headers = upstream_headers(state, request, ctx)
    for backend in pool.backends:
        with contextlib.suppress(ProxyError):
            response = await backend.upstream.open("GET", f"/responses/{response_id}", headers=headers)
            await backend.upstream.read(response)
            if response.status_code == 200:
                return backend.name
    return None


routes = [
    Route("/v1/responses", api_endpoint(RESPONSES.route, create, RESPONSES_API), methods=["POST"]),
    Route("/v1/responses/{response_id}", api_endpoint("responses_retrieve", retrieve), methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/cancel", api_endpoint("responses_cancel", retrieve), methods=["POST"]),
    # Every other path under a stored response is that response's too: owned here (the ownership
    # check), never left to the pass-through route.
    Route(
        "/v1/responses/{response_id}/{rest:path}",
        api_endpoint("responses_stored", retrieve),
        methods=["GET", "POST", "DELETE"],
    ),
]
