"""The forwarded API's fixed paths, served without the framework's middleware stack.

Every request through FastAPI passes about ten ASGI layers (error and exception middleware, an
exit stack, route matching over every route) before its endpoint runs. The forwarded endpoints
need none of it: they answer their own errors (:func:`proxy.routes.forward.api_endpoint`). A
request whose method and path name one of them exactly goes straight to it; anything else (a
path with parameters, a mounted app with a root path) takes the framework's way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class _Headers(Headers):
    """Starlette's request headers, with ``get`` answering a missing name without an exception
    (``Mapping.get`` catches a ``KeyError`` per miss, and a request asks for several it lacks)."""

    def get(self, key: str, default: Any = None) -> Any:
        name = key.lower().encode("latin-1")
        for header, value in self._list:
            if header == name:
                return value.decode("latin-1")
        return default


class DirectRequest(Request):
    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_headers"):
            self._headers = _Headers(scope=self.scope)
        return self._headers


class DirectRoutes:
    """Endpoints by exact ``(method, path)``, taken from routes without path parameters."""

    def __init__(self, routes: Iterable[BaseRoute] = ()) -> None:
        self._endpoints: dict[tuple[str, str], Endpoint] = {}
        for route in routes:
            if isinstance(route, Route) and "{" not in route.path and route.methods:
                for method in route.methods:
                    self._endpoints[(method, route.path)] = route.endpoint

    def match(self, scope: Scope) -> Endpoint | None:
        if scope["type"] != "http" or scope.get("root_path"):
            return None
        return self._endpoints.get((scope["method"], scope["path"]))


async def serve_direct(
    app: ASGIApp,
    endpoint: Endpoint,
    on_error: Callable[[Exception], Response],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """Run ``endpoint`` as the framework would: ``request.app`` is ``app``; an exception before
    the response started is answered by ``on_error`` (after it, the server closes the connection)."""
    scope["app"] = app
    started = False

    async def send_tracked(message: Message) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        response = await endpoint(DirectRequest(scope, receive, send))
        await response(scope, receive, send_tracked)
    except Exception as exc:
        if started:
            raise
        await on_error(exc)(scope, receive, send)
