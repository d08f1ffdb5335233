"""Session inspection: an operator API (admin key, any tenant) and a tenant's own view (its key).

Both read through the same tenant-namespaced store calls, so a tenant key can
only ever name its own sessions.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from proxy.app_state import ProxyState, get_state
from proxy.chat import effective_budget, usage_limits
from proxy.http import (
    Forbidden,
    InvalidLimit,
    ProxyError,
    ServiceUnavailable,
    SessionNotFound,
    Unauthorized,
    json_response,
)
from proxy.sessions import SessionRecord, StoreUnavailable
from proxy.tenants import Tenant, bearer_token

router = APIRouter()


def require_admin(state: ProxyState, request: Request) -> None:
    configured = state.settings.admin_api_key
    if configured is None or not configured.get_secret_value():
        # An empty key (PREFIX_PROXY_ADMIN_API_KEY= from a template) disables the API: it must not
        # match a request that sends no key at all.
        raise Forbidden("the admin API is disabled (set admin_api_key)")
    token = bearer_token(request.headers.get("authorization")) or ""
    if not hmac.compare_digest(token.encode(), configured.get_secret_value().encode()):
        raise Unauthorized("invalid admin key")


async def _describe(state: ProxyState, tenant: Tenant, record: SessionRecord) -> dict[str, Any]:
    budget = effective_budget(state.settings.budget, None, tenant.budget)
    view: dict[str, Any] = record.to_json()
    view["summary_state"] = (
        {"covered_messages": len(record.summary.get("covered", [])), "tokens": record.summary.get("tokens")}
        if record.summary
        else None
    )
    budget_left = {}
    for limit in usage_limits(budget, tenant.name, record.session_id):
        used = await state.sessions.used(limit, budget.window_s)
        budget_left[limit.kind] = max(0, limit.limit - used)
    view["budget_left"] = budget_left
    return view


TenantResolver = Callable[[ProxyState], Awaitable[Tenant]]
Action = Callable[[ProxyState, Tenant], Awaitable[Response]]


def _as_admin(request: Request, tenant: str) -> TenantResolver:
    async def resolve(state: ProxyState) -> Tenant:
        require_admin(state, request)
        return state.tenants.named(tenant)

    return resolve


def _as_caller(request: Request) -> TenantResolver:
    async def resolve(state: ProxyState) -> Tenant:
        return await state.tenants.authenticate(request.headers.get("authorization"))

    return resolve


async def _run(request: Request, resolve: TenantResolver, action: Action) -> Response:
    state = get_state(request)
    try:
        return await action(state, await resolve(state))
    except StoreUnavailable:
        return ServiceUnavailable("the session store is unavailable").response()
    except ProxyError as error:
        return error.response()


async def _list(state: ProxyState, tenant: Tenant, limit: int) -> Response:
    records = await state.sessions.call(state.sessions.store.list_sessions(tenant.name, limit))
    return json_response({"object": "list", "tenant": tenant.name, "data": [r.to_json() for r in records]})


async def _get(state: ProxyState, tenant: Tenant, session_id: str) -> Response:
    record = await state.sessions.call(state.sessions.store.get(tenant.name, session_id))
    if record is None:
        raise SessionNotFound(session_id)
    return json_response(await _describe(state, tenant, record))


async def _delete(state: ProxyState, tenant: Tenant, session_id: str) -> Response:
    deleted = await state.sessions.call(state.sessions.store.delete(tenant.name, session_id))
    if not deleted:
        raise SessionNotFound(session_id)
    return json_response({"id": session_id, "deleted": True})


DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def list_limit(request: Request) -> int:
    """``?limit=``: an integer from 1; more than :data:`MAX_LIMIT` lists that many.

    Read by hand rather than declared as an ``int`` parameter: FastAPI would answer a bad value
    with its own 422 shape, and 0 or a negative number would reach the store (where Redis reads
    ``-1`` as "up to the last element").
    """
    raw = request.query_params.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise InvalidLimit()
    return min(int(text), MAX_LIMIT)


@router.get("/admin/tenants/{tenant}/sessions")
async def admin_list(request: Request, tenant: str) -> Response:
    return await _run(request, _as_admin(request, tenant), lambda state, t: _list(state, t, list_limit(request)))


@router.get("/admin/tenants/{tenant}/sessions/{session_id}")
async def admin_get(request: Request, tenant: str, session_id: str) -> Response:
    return await _run(request, _as_admin(request, tenant), lambda state, t: _get(state, t, session_id))


@router.delete("/admin/tenants/{tenant}/sessions/{session_id}")
async def admin_delete(request: Request, tenant: str, session_id: str) -> Response:
    return await _run(request, _as_admin(request, tenant), lambda state, t: _delete(state, t, session_id))


@router.get("/v1/sessions")
async def own_list(request: Request) -> Response:
    return await _run(request, _as_caller(request), lambda state, t: _list(state, t, list_limit(request)))


@router.get("/v1/sessions/{session_id}")
async def own_get(request: Request, session_id: str) -> Response:
    return await _run(request, _as_caller(request), lambda state, t: _get(state, t, session_id))


@router.delete("/v1/sessions/{session_id}")
async def own_delete(request: Request, session_id: str) -> Response:
    return await _run(request, _as_caller(request), lambda state, t: _delete(state, t, session_id))
