"""A recording HTTP forwarder (ASGI): what a client sent, or what a backend received, byte for byte.

Put one in front of any HTTP server; every exchange is kept in ``Recorder.exchanges`` (request method,
path, headers and body as received; response status, headers and body). ``inject`` may change the JSON
body that is forwarded (never the recorded one): the bench uses it to send the fake backend's
``fake_options`` test hook, which makes the fake answer with plain text instead of its tool-calling
policy, so every agent loop ends after one model call per turn.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

Inject = Callable[[str, dict[str, Any]], dict[str, Any] | None]

_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
_MAX_RESPONSE_BYTES = 4 << 20


@dataclass
class Exchange:
    """One request and its answer, as seen at the recorder."""

    seq: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    started_at: float = field(default_factory=time.time)
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytearray = field(default_factory=bytearray)
    error: str | None = None
    seconds: float = 0.0

    def json_body(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except (ValueError, UnicodeDecodeError):
            return None

    def to_json(self, bodies: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "seq": self.seq,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "request_headers": self.headers,
            "response_headers": self.response_headers,
        }
        if bodies:
            data["body"] = self.json_body() if self.json_body() is not None else self.body.decode("utf-8", "replace")
            data["response_body"] = bytes(self.response_body).decode("utf-8", "replace")
        return data


class Recorder:
    """ASGI app forwarding every request to ``upstream`` (scheme://host:port, no path) and recording it."""

    def __init__(self, upstream: str, *, inject: Inject | None = None, name: str = "recorder") -> None:
        self.upstream = upstream.rstrip("/")
        self.inject = inject
        self.name = name
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    def snapshot(self) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges)

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._client is not None:
                        await self._client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        with self._lock:
            exchange = Exchange(len(self.exchanges), scope["method"], path, headers, body)
            self.exchanges.append(exchange)
        forwarded = body
        if self.inject is not None and scope["method"] == "POST":
            parsed = exchange.json_body()
            if isinstance(parsed, dict):
                changed = self.inject(scope["path"], parsed)
                if changed is not None:
                    forwarded = json.dumps(changed).encode()
        out_headers = [(k, v) for k, v in headers.items() if k not in _HOP_BY_HOP]
        assert self._client is not None
        started = time.monotonic()
        try:
            request = self._client.build_request(
                scope["method"], self.upstream + path, headers=out_headers, content=forwarded
            )
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            exchange.status, exchange.error = 502, f"{type(exc).__name__}: {exc}"
            exchange.seconds = time.monotonic() - started
            await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": exchange.error.encode()})
            return
        exchange.status = response.status_code
        exchange.response_headers = {k.lower(): v for k, v in response.headers.items()}
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in response.headers.multi_items()
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-encoding"
                    ],
                }
            )
            async for chunk in response.aiter_bytes():
                if len(exchange.response_body) < _MAX_RESPONSE_BYTES:
                    exchange.response_body.extend(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx.HTTPError, OSError) as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        finally:
            await response.aclose()
            exchange.seconds = time.monotonic() - started
