"""``GET /ui``: the operator's page (``ui.enabled``; docs/metrics.md, "The operator's page").

Who may read it: the admin key, as the password of HTTP Basic (any user name: the browser asks for
it; nothing else to set up) or as ``Authorization: Bearer`` (curl, scripts). Basic over the admin
key was chosen over a ``?key=`` that sets a cookie: a key in a URL lands in access logs, browser
history and ``Referer`` headers, and a cookie is state a cross-site request carries; Basic
credentials go only to this origin, and the page is read-only (GET, no form, no script). A request
without credentials gets 401 with a Basic challenge (the browser's prompt); a tenant's key gets 403
and nothing else; any other key 401. The page is never cached (``no-store``), never framed, and
runs no script (Content-Security-Policy). Serve it on a listen address of its own with
``metrics_port`` (then it is there, beside ``/metrics``, and the API port answers 404).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy import __version__
from proxy.app_state import ProxyState
from proxy.chat import effective_budget, usage_limits
from proxy.config import Settings
from proxy.http import ProxyError
from proxy.observability import (
    CONTENT_SECURITY_POLICY,
    AppBook,
    SessionRow,
    Snapshot,
    TenantView,
    Totals,
    render,
    tenant_names,
)
from proxy.sessions import StoreUnavailable
from proxy.tenants import ANONYMOUS

PATH = "/ui"
REALM = 'Basic realm="prefix-proxy operator", charset="UTF-8"'
SECURITY_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def book(settings: Settings) -> AppBook | None:
    """What the page reads, recorded from every answered chat request; None while the page is off."""
    ui = settings.ui
    if not ui.enabled:
        return None
    return AppBook(
        # Prompt text only where the operator already has the proxy keep it (the access log, the capture).
        keep_text=settings.log_prompts or bool(settings.capture.path),
        max_apps=ui.max_apps,
        floor_lines=ui.floor_lines,
        breaks=ui.breaks,
        prompt_chars=ui.prompt_chars,
    )


def route(state: ProxyState) -> Route:
    """``GET /ui`` for ``state``: on the API's own port, or beside ``/metrics`` on ``metrics_port``."""

    async def page(request: Request) -> Response:
        refused = await _refusal(state, request)
        if refused is not None:
            return refused
        html = render(await snapshot(state))
        return Response(html, 200, headers=SECURITY_HEADERS, media_type="text/html; charset=utf-8")

    return Route(PATH, page, methods=["GET"])


def presented_key(authorization: str | None) -> str | None:
    """The key a request presents: a bearer token, or the password of HTTP Basic credentials."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


async def _refusal(state: ProxyState, request: Request) -> Response | None:
    """None for the admin; else the answer: 404 (no admin key: the page is off), 401 with a Basic
    challenge (no key, a wrong one), 403 (a tenant's key)."""
    configured = state.settings.admin_api_key
    if configured is None or not configured.get_secret_value():
        return _plain("not found", 404)
    key = presented_key(request.headers.get("authorization"))
    if key is None:
        return _plain("the admin key is needed (HTTP Basic: any user name, the admin key as password)", 401, True)
    if hmac.compare_digest(key.encode("utf-8", "surrogatepass"), configured.get_secret_value().encode()):
        return None
    if await _tenant_key(state, key):
        return _plain("forbidden: this page is the operator's (admin key)", 403)
    return _plain("invalid admin key", 401, True)


async def _tenant_key(state: ProxyState, key: str) -> bool:
    if state.tenants.open:
        return False
    try:
        tenant = await state.tenants.authenticate(f"Bearer {key}")
    except ProxyError:
        return False
    return tenant.name != ANONYMOUS


def _plain(text: str, status: int, challenge: bool = False) -> Response:
    headers = dict(SECURITY_HEADERS)
    if challenge:
        headers["www-authenticate"] = REALM
    return Response(text + "\n", status, headers=headers, media_type="text/plain; charset=utf-8")


async def snapshot(state: ProxyState) -> Snapshot:
    apps = state.apps
    settings = state.settings
    notes = []
    if not settings.cache_breaks.enabled:
        notes.append("cache_breaks.enabled is false: no cache break is explained or listed.")
    seen = apps.tenants() if apps is not None else []
    names = tenant_names((t.name for t in settings.tenants), seen)
    tenants = [await _tenant_view(state, name) for name in names]
    return Snapshot(
        apps=apps.apps() if apps is not None else [],
        breaks=apps.breaks() if apps is not None else [],
        totals=apps.totals() if apps is not None else Totals(0, 0, 0, 0, 0),
        tenants=tenants,
        show_text=apps.keep_text if apps is not None else False,
        now=time.time(),
        version=__version__,
        canon_mode=settings.canon.mode,
        notes=notes,
    )


async def _tenant_view(state: ProxyState, name: str) -> TenantView:
    settings = state.settings
    tenant = state.tenants.named(name)
    budget = effective_budget(settings.budget, None, tenant.budget)
    sessions = state.sessions
    view = TenantView(
        name,
        session_limit=budget.session_tokens_per_window,
        tenant_limit=budget.tenant_tokens_per_window,
        window_s=budget.window_s,
    )
    try:
        tenant_used = None
        for limit in usage_limits(budget, name, None):
            if limit.kind == "tenant":
                tenant_used = await sessions.used(limit, budget.window_s)
        rows = []
        if settings.ui.sessions:
            records = await sessions.call(sessions.store.list_sessions(name, settings.ui.sessions))
            for record in records:
                left = None
                for limit in usage_limits(budget, name, record.session_id):
                    if limit.kind == "session":
                        left = max(0, limit.limit - await sessions.used(limit, budget.window_s))
                covered = record.summary.get("covered") if record.summary else None
                rows.append(
                    SessionRow(
                        record.session_id,
                        record.requests,
                        record.prompt_tokens,
                        record.cached_tokens,
                        record.context_tokens,
                        record.last_seen,
                        len(covered) if isinstance(covered, list) else None,
                        left,
                    )
                )
    except StoreUnavailable:
        return TenantView(
            name, view.session_limit, view.tenant_limit, None, view.window_s, (), "the session store is unavailable"
        )
    return TenantView(name, view.session_limit, view.tenant_limit, tenant_used, view.window_s, rows)
