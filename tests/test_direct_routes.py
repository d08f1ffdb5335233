"""The forwarded API's fixed paths skip the framework's own layers: they must answer as if they did
not, and middleware added to the app wraps them as it wraps every route."""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.app import ProxyApp
from proxy.http.direct import DirectRoutes
from proxy.http.errors import ProxyError


async def ok(request: Request) -> Response:
    return JSONResponse({"app_is_set": request.app is not None, "body": (await request.body()).decode()})


async def boom(_: Request) -> Response:
    raise RuntimeError("a bug")


async def refused(_: Request) -> Response:
    raise ProxyError(429, "slow down", code="rate_limited")


def make_app() -> ProxyApp:
    routes = [
        Route("/v1/ok", ok, methods=["POST"]),
        Route("/v1/boom", boom, methods=["POST"]),
        Route("/v1/refused", refused, methods=["POST"]),
        Route("/v1/items/{item}", ok, methods=["POST"]),
    ]
    app = ProxyApp()
    app.router.routes.extend(routes)
    app.direct = DirectRoutes(routes)
    return app


async def test_fixed_paths_are_served_directly_and_the_rest_by_the_framework() -> None:
    app = make_app()
    assert app.direct.match({"type": "http", "method": "POST", "path": "/v1/ok"}) is ok
    assert app.direct.match({"type": "http", "method": "GET", "path": "/v1/ok"}) is None
    assert app.direct.match({"type": "http", "method": "POST", "path": "/v1/items/3"}) is None
    assert app.direct.match({"type": "http", "method": "POST", "path": "/v1/ok", "root_path": "/api"}) is None
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        direct = await client.post("/v1/ok", content=b"hello")
        assert direct.json() == {"app_is_set": True, "body": "hello"}
        routed = await client.post("/v1/items/3", content=b"x")
        assert routed.json() == {"app_is_set": True, "body": "x"}
        assert (await client.get("/v1/ok")).status_code == 405


async def test_an_exception_gets_the_proxy_error_shape_not_a_traceback() -> None:
    transport = httpx.ASGITransport(app=make_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        crashed = await client.post("/v1/boom")
        assert crashed.status_code == 500
        assert crashed.json()["error"]["code"] == "internal_error"
        assert "a bug" not in crashed.text
        refused = await client.post("/v1/refused")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"


async def test_middleware_added_to_the_app_wraps_the_direct_endpoints_too() -> None:
    """A middleware an operator adds (auth, a header, a log) cannot miss the pipeline's endpoints."""
    from proxy.app import create_app
    from proxy.config import Settings

    seen: list[str] = []
    app = create_app(Settings(upstream="http://127.0.0.1:9/v1"))

    @app.middleware("http")
    async def mark(request: Request, call_next: object) -> Response:
        seen.append(request.url.path)
        response: Response = await call_next(request)  # type: ignore[operator]
        response.headers["x-marked"] = "yes"
        return response

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        chat = await client.post(
            "/v1/chat/completions", content=b"not json", headers={"content-type": "application/json"}
        )
        health = await client.get("/healthz")
    assert chat.status_code == 400 and chat.headers["x-marked"] == "yes"
    assert health.headers["x-marked"] == "yes"
    assert seen == ["/v1/chat/completions", "/healthz"]
