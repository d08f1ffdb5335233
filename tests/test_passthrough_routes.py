"""The backend's other routes through the proxy: forwarded unbuffered, tenant-authenticated,
counted per route; operator routes only with the admin key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer, free_port


class Recorder:
    """An upstream that records how each request arrived."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: Request) -> Response:
        chunks = [chunk async for chunk in request.stream()]
        self.seen.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "headers": dict(request.headers),
                "chunks": len([c for c in chunks if c]),
                "body": b"".join(chunks),
            }
        )
        if request.url.path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{"id": "m"}]})
        if request.url.path == "/slow-stream":

            async def drip() -> Any:
                for index in range(3):
                    yield f"data: {index}\n\n".encode()
                    await asyncio.sleep(0.05)

            return StreamingResponse(drip(), media_type="text/event-stream")
        if request.url.path == "/missing":
            return Response("<html>nope</html>", status_code=404, media_type="text/html")
        return JSONResponse({"path": request.url.path, "bytes": sum(len(c) for c in chunks)})


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, LiveServer]]:
    rec = Recorder()
    app = Starlette(routes=[Route("/{path:path}", rec.handle, methods=["GET", "POST", "PUT", "DELETE"])])
    server = LiveServer(app).start()
    yield rec, server
    server.stop()


# What the proxy asks a backend of its own accord: its model list, and where that gives no context,
# what the server says of itself (llama-server's /props, TGI's /info).
PROXY_PROBES = frozenset({"/v1/models", "/props", "/info"})


def forwarded(rec: Recorder) -> list[dict[str, Any]]:
    """What the backend got for clients' requests: the proxy's own probes aside."""
    return [r for r in rec.seen if not (r["method"] == "GET" and r["path"] in PROXY_PROBES)]


def proxy_for(upstream: LiveServer, **settings: Any) -> LiveServer:
    return LiveServer(create_app(Settings(upstream=upstream.url + "/v1", **settings))).start()


def test_known_routes_reach_the_backend_root_or_api(proxy: LiveServer) -> None:
    tokenized = httpx.post(proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "hello world"})
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 2
    assert "x-prefix-proxy-overhead-ms" in tokenized.headers
    assert httpx.post(proxy.url + "/detokenize", json={"tokens": tokenized.json()["tokens"]}).json() == {
        "prompt": "hello world"
    }
    assert httpx.get(proxy.url + "/version").json()["version"]
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'route="tokenize"' in metrics and 'route="version"' in metrics


def test_multipart_upload_streams_through(recorder: tuple[Recorder, LiveServer]) -> None:
    rec, upstream = recorder
    proxy = proxy_for(upstream)
    try:

        def audio() -> Iterator[bytes]:
            for _ in range(16):
                yield b"\x00" * 65536

        boundary = "b0undary"
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'.encode()
        tail = f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--{boundary}--\r\n'

        def body() -> Iterator[bytes]:
            yield head
            yield from audio()
            yield tail.encode()

        response = httpx.post(
            proxy.url + "/v1/audio/transcriptions?language=en",
            content=body(),
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )
        assert response.status_code == 200, response.text
        seen = forwarded(rec)[-1]
        assert seen["path"] == "/v1/audio/transcriptions" and seen["query"] == "language=en"
        assert seen["headers"]["content-type"] == f"multipart/form-data; boundary={boundary}"
        assert seen["body"].startswith(head) and len(seen["body"]) == len(head) + 16 * 65536 + len(tail)
        assert seen["chunks"] > 1  # arrived in pieces: not buffered into one
        assert 'route="audio_transcriptions"' in httpx.get(proxy.url + "/metrics").text
    finally:
        proxy.stop()


def test_streamed_answer_and_unknown_route(recorder: tuple[Recorder, LiveServer]) -> None:
    _, upstream = recorder
    proxy = proxy_for(upstream)
    try:
        with httpx.stream("GET", proxy.url + "/slow-stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            assert list(response.iter_lines())[:1] == ["data: 0"]
        missing = httpx.get(proxy.url + "/missing")
        assert missing.status_code == 404 and "html" not in missing.text
        assert missing.json()["error"]["message"]
        assert 'route="other"' in httpx.get(proxy.url + "/metrics").text
    finally:
        proxy.stop()


def test_operator_routes_need_the_admin_key(recorder: tuple[Recorder, LiveServer]) -> None:
    rec, upstream = recorder
    tenants = [{"name": "acme", "api_key": "sk-acme"}]
    proxy = proxy_for(upstream, tenants=tenants, admin_api_key="adm", upstream_api_key="up-key")
    try:
        as_tenant = {"authorization": "Bearer sk-acme"}
        for path in ("/reset_prefix_cache", "//reset_prefix_cache/", "/collective_rpc", "/v1/load_lora_adapter"):
            assert httpx.post(proxy.url + path, headers=as_tenant, json={}).status_code == 401
        assert httpx.post(proxy.url + "/sleep", json={}).status_code == 401
        assert not forwarded(rec)  # none of them reached the backend
        response = httpx.post(proxy.url + "/reset_prefix_cache", headers={"authorization": "Bearer adm"})
        assert response.status_code == 200
        seen = forwarded(rec)[-1]
        assert seen["path"] == "/reset_prefix_cache"
        assert seen["headers"]["authorization"] == "Bearer up-key"  # never the admin key
        # A tenant reaches the other routes with its key only; the upstream gets the proxy's key.
        assert httpx.post(proxy.url + "/tokenize", json={"model": "m"}).status_code == 401
        assert httpx.post(proxy.url + "/tokenize", json={"model": "m"}, headers=as_tenant).status_code == 200
        assert forwarded(rec)[-1]["headers"]["authorization"] == "Bearer up-key"
        assert httpx.post(proxy.url + "/a/../reset_prefix_cache", headers=as_tenant).status_code in (400, 401, 404)
    finally:
        proxy.stop()


def test_llama_server_and_ollama_routes_outside_the_pipeline(recorder: tuple[Recorder, LiveServer]) -> None:
    """llama-server answers generation outside /v1 (``/chat/completions``, ``/completion``, its
    Ollama-style ``/api/chat``) and exposes its slots and adapters; Ollama manages models. A tenant
    under a budget generates through the pipeline only, and never reaches an operator's route."""
    rec, upstream = recorder
    tenants = [{"name": "acme", "api_key": "sk-acme", "budget": {"tenant_tokens_per_window": 1000}}]
    proxy = proxy_for(upstream, tenants=tenants, admin_api_key="adm", upstream_api_key="up-key")
    try:
        as_tenant = {"authorization": "Bearer sk-acme"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
        before = len(forwarded(rec))
        for path in ("/chat/completions", "/completions", "/completion", "/infill", "/api/chat", "/api/generate"):
            response = httpx.post(proxy.url + path, headers=as_tenant, json=chat)
            assert response.status_code == 404, path
            assert "/v1/chat/completions" in response.json()["error"]["message"]
        for path in ("/slots", "/slots/0?action=erase", "/lora-adapters", "/api/pull", "/api/delete"):
            assert httpx.post(proxy.url + path, headers=as_tenant, json={}).status_code == 401, path
        assert httpx.get(proxy.url + "/slots", headers=as_tenant).status_code == 401
        assert len(forwarded(rec)) == before  # none of them reached the backend
        assert httpx.get(proxy.url + "/slots", headers={"authorization": "Bearer adm"}).status_code == 200
        assert forwarded(rec)[-1]["path"] == "/slots"
        # What does not generate stays a tenant's: llama-server's token counts and template.
        assert httpx.post(proxy.url + "/apply-template", headers=as_tenant, json={"messages": []}).status_code == 200
    finally:
        proxy.stop()
    # An open proxy with no budget governs nothing there: llama-server's own routes are forwarded.
    open_proxy = proxy_for(upstream)
    try:
        assert httpx.post(open_proxy.url + "/completion", json={"prompt": "x"}).status_code == 200
        assert forwarded(rec)[-1]["path"] == "/completion"
    finally:
        open_proxy.stop()


@pytest.mark.parametrize("media_type", ["application/json", "application/x+json", "text/plain", None])
def test_a_body_engines_parse_as_json_is_held_to_the_depth_limit(
    recorder: tuple[Recorder, LiveServer], media_type: str | None
) -> None:
    """FastAPI (vLLM) parses a ``+json`` body and one with no type as JSON, llama-server any body: on
    the pass-through each is read whole, as ``application/json`` is, so the depth limit holds and its
    model routes it (before: streamed past the limit as an upload)."""
    rec, upstream = recorder
    proxy = proxy_for(upstream)
    try:
        headers = {"content-type": media_type} if media_type else {}
        before = len(forwarded(rec))
        deep = b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        response = httpx.post(proxy.url + "/tokenize", content=deep, headers=headers)
        assert response.status_code == 400 and "nests deeper" in response.json()["error"]["message"]
        assert len(forwarded(rec)) == before
        plain = httpx.post(proxy.url + "/tokenize", content=b'{"model": "m", "prompt": "x"}', headers=headers)
        assert plain.status_code == 200 and forwarded(rec)[-1]["body"] == b'{"model": "m", "prompt": "x"}'
    finally:
        proxy.stop()


def test_operator_routes_without_admin_key_are_403(proxy: LiveServer) -> None:
    response = httpx.post(proxy.url + "/reset_prefix_cache")
    assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"


def test_allow_and_deny_lists(recorder: tuple[Recorder, LiveServer]) -> None:
    _, upstream = recorder
    proxy = proxy_for(upstream, routes={"allowed_routes": ["/tokenize", "/v1/*"], "denied_routes": ["/v1/score"]})
    try:
        assert httpx.post(proxy.url + "/tokenize", json={}).status_code == 200
        assert httpx.post(proxy.url + "/v1/rerank", json={}).status_code == 200
        assert httpx.post(proxy.url + "/v1/score", json={}).status_code == 404
        assert httpx.post(proxy.url + "/pooling", json={}).status_code == 404
    finally:
        proxy.stop()


def test_proxy_paths_are_never_forwarded(recorder: tuple[Recorder, LiveServer]) -> None:
    rec, upstream = recorder
    proxy = proxy_for(upstream, metrics_port=free_port())  # /metrics elsewhere: not on the API port
    try:
        before = len(forwarded(rec))
        assert httpx.get(proxy.url + "/metrics").status_code == 404
        assert httpx.get(proxy.url + "/admin/whatever").status_code == 404
        assert httpx.put(proxy.url + "/v1/chat/completions").status_code == 405
        assert len(forwarded(rec)) == before
    finally:
        proxy.stop()


def test_passthrough_can_be_switched_off(proxy: LiveServer, make_proxy: Any) -> None:
    closed = make_proxy(routes={"passthrough": False})
    assert httpx.post(closed.url + "/tokenize", json={"model": "fake-model", "prompt": "x"}).status_code == 404


GOVERNED_TENANTS = [{"name": "acme", "api_key": "sk-acme", "budget": {"tenant_tokens_per_window": 1000}}]
AS_TENANT = {"authorization": "Bearer sk-acme"}


def test_root_copies_and_image_routes_of_the_engines_are_generation_outside_the_pipeline(
    recorder: tuple[Recorder, LiveServer],
) -> None:
    """llama-server serves POST /responses and /audio/transcriptions beside their /v1 routes (the same
    handlers); Ollama's /v1/images/generations and /v1/images/edits run its generate handler: with
    budgets governing generation, each is 404 and nothing reaches the engine."""
    rec, upstream = recorder
    proxy = proxy_for(upstream, tenants=GOVERNED_TENANTS, admin_api_key="adm", upstream_api_key="up-key")
    try:
        before = len(forwarded(rec))
        body = {"model": "m", "input": "hi", "prompt": "a cat", "max_output_tokens": 100000}
        paths = ("/responses", "/audio/transcriptions", "/v1/images/generations", "/v1/images/edits")
        answered = {path: httpx.post(proxy.url + path, headers=AS_TENANT, json=body) for path in paths}
        assert {path: r.status_code for path, r in answered.items()} == dict.fromkeys(paths, 404)
        assert all("generates outside the proxy's pipeline" in r.text for r in answered.values())
        assert len(forwarded(rec)) == before
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        # Ollama's ollama.com account: signing the server out, its name, searches it pays for.
        ("POST", "/api/signout"),
        ("DELETE", "/api/user/keys/c3NoLWVkMjU1MTk"),
        ("POST", "/api/me"),
        ("POST", "/api/experimental/web_search"),
        ("POST", "/api/experimental/web_fetch"),
        # llama-server's router mode removes and downloads models; its URL fetcher, tools, settings.
        ("DELETE", "/models?model=llama"),
        ("POST", "/models"),
        ("GET", "/cors-proxy?url=http://169.254.169.254/"),
        ("POST", "/tools"),
        ("POST", "/props"),
    ],
)
def test_engine_operator_routes_need_the_admin_key(
    recorder: tuple[Recorder, LiveServer], method: str, path: str
) -> None:
    """Open or not, these reach the engine with the admin key only (and with the proxy's own key)."""
    rec, upstream = recorder
    for tenants in ([], GOVERNED_TENANTS):
        proxy = proxy_for(upstream, tenants=tenants, admin_api_key="adm", upstream_api_key="up-key")
        try:
            before = len(forwarded(rec))
            refused = httpx.request(method, proxy.url + path, headers=AS_TENANT, json={"query": "x"})
            assert refused.status_code in (401, 403), (tenants, refused.status_code)
            assert len(forwarded(rec)) == before
            admitted = httpx.request(method, proxy.url + path, headers={"authorization": "Bearer adm"}, json={})
            assert admitted.status_code == 200
            assert forwarded(rec)[-1]["headers"]["authorization"] == "Bearer up-key"
        finally:
            proxy.stop()


def test_a_governed_proxy_forwards_tenants_only_the_routes_known_to_be_theirs(
    recorder: tuple[Recorder, LiveServer],
) -> None:
    """A route no list names (an engine's next generation route, an operator route nobody listed)
    is 404 for a tenant while tenants or budgets govern generation; the listed ones are forwarded,
    a method-qualified pattern by its method (GET /models is llama-server's model list, DELETE
    /models removes one). An open proxy forwards what the engine serves, and allowed_routes is
    the operator's way to open a route."""
    rec, upstream = recorder
    governed = proxy_for(upstream, tenants=GOVERNED_TENANTS, admin_api_key="adm")
    open_proxy = proxy_for(upstream, admin_api_key="adm")
    opened = proxy_for(upstream, tenants=GOVERNED_TENANTS, routes={"allowed_routes": ["/v1/new_route", "/tokenize"]})
    try:
        unknown = httpx.post(governed.url + "/v1/new_route", headers=AS_TENANT, json={"model": "m"})
        assert unknown.status_code == 404
        assert "routes.allowed_routes" in unknown.json()["error"]["message"]
        assert not [r for r in forwarded(rec) if r["path"] == "/v1/new_route"]
        for method, path in (("POST", "/tokenize"), ("GET", "/models"), ("GET", "/props"), ("POST", "/api/embed")):
            assert httpx.request(method, governed.url + path, headers=AS_TENANT, json={}).status_code == 200, path
        assert httpx.get(governed.url + "/props", headers=AS_TENANT).status_code == 200
        assert httpx.post(open_proxy.url + "/v1/new_route", json={"model": "m"}).status_code == 200
        assert httpx.post(opened.url + "/v1/new_route", headers=AS_TENANT, json={"model": "m"}).status_code == 200
        assert httpx.post(opened.url + "/v1/score", headers=AS_TENANT, json={"model": "m"}).status_code == 404
    finally:
        governed.stop()
        open_proxy.stop()
        opened.stop()


def test_head_reaches_a_tenants_get_route() -> None:
    """A GET route answers HEAD too, as every router in front of the engines does."""
    from proxy.routes.passthrough import route_decision

    app = create_app(Settings(tenants=GOVERNED_TENANTS))
    assert route_decision(app.state.proxy, "/health", "GET") == "forward"
    assert route_decision(app.state.proxy, "/health", "HEAD") == "forward"
    assert route_decision(app.state.proxy, "/health", "POST") == "unlisted"
