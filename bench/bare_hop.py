"""The proxy's server and upstream client with none of its logic: the floor of its stack.

uvicorn (as ``prefix-proxy serve`` runs it) and Starlette routes (chat completions, messages) that
forward the body through the proxy's own :class:`~proxy.backends.upstream.Upstream` (aiohttp
underneath) and relay the answer's bytes, whole (an SSE answer too: the instant backend's is short).
``bench.hop`` runs it next to prefix-proxy: the difference is what the proxy's logic
(canonicalization, sessions, budgets, metrics, the access log) costs per request.

``--json``: the same, and the request body parsed and written again (``proxy.openai.loads`` and
``dumps_body``, as the proxy does) and a JSON answer parsed (the proxy reads its usage): the floor
of any proxy that reads and rewrites the body in Python, before any logic of its own.

    python -m bench.bare_hop --upstream http://127.0.0.1:8000/v1 --port 8001 [--json]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from bench.allocator import KEEP_FREED_BYTES, keep_freed_memory
from proxy.backends import Upstream
from proxy.openai import dumps_body, loads
from proxy.serve import SERVER_OPTIONS


def create_app(upstream_url: str, *, json: bool = False) -> Starlette:
    """``json``: the body parsed and written again, a JSON answer parsed (module docstring)."""
    upstream = Upstream(upstream_url)

    async def forward(request: Request) -> Response:
        headers = {"content-type": "application/json"}
        path = request.url.path.removeprefix("/v1")
        body = await request.body()
        if json:
            body = dumps_body(loads(body))
        response = await upstream.open("POST", path, content=body, headers=headers)
        raw = await upstream.read(response)
        kind = response.headers.get("content-type", "application/json")
        if json and kind.startswith("application/json"):
            loads(raw)
        return Response(raw, status_code=response.status_code, media_type=kind)

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await upstream.aclose()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", forward, methods=["POST"]),
            Route("/v1/messages", forward, methods=["POST"]),
            Route("/healthz", health),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_hop", description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--json", action="store_true", help="parse and write the body again")
    args = parser.parse_args()
    # Large freed buffers kept for the next request, as prefix-proxy's kept state keeps its heap
    # (bench/allocator.py): otherwise the floor pays page faults the proxy does not.
    keep_freed_memory(KEEP_FREED_BYTES)
    uvicorn.run(create_app(args.upstream, json=args.json), host="127.0.0.1", port=args.port, **SERVER_OPTIONS)


if __name__ == "__main__":
    main()
