"""An upstream that misbehaves on purpose, at the socket level: what uvicorn would never let an
app do (drop the connection after reading the request, drip bytes, send an event without end).

A raw asyncio HTTP/1.1 server in a background thread. The request's ``model`` picks the
behaviour (see ``HostileUpstream._behave``); every request is counted by model, so a test can
tell how often a request was sent. ``lenient=True`` answers any other model like ``ok`` (for
fuzzing the proxy: then any 5xx is the proxy's own).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from typing import Any

from bench.servers import free_port

OK_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "ok",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}

# What "ok" answers on the other protocols: each with the list its protocol requires.
OK_MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "ok",
    "content": [{"type": "text", "text": "fine"}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 5, "output_tokens": 1},
}
OK_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "model": "ok",
    "status": "completed",
    "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "fine"}]}],
    "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6},
}


def _ok_body(path: str) -> dict[str, Any]:
    if path.rstrip("/").endswith("/messages"):
        return OK_MESSAGE
    if path.rstrip("/").endswith("/responses"):
        return OK_RESPONSE
    return OK_CHAT


BEHAVIOURS = frozenset(
    {
        "ok",
        "drop",
        "hang",
        "cut",
        "cut-mid",
        "html-error",
        "not-json",
        "json-for-stream",
        "drip",
        "unterminated",
        "malformed-chunk",
        "linger",
    }
)


def _chunk(content: str) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class HostileUpstream:
    def __init__(
        self, *, lenient: bool = False, behaviour: str | None = None, models: tuple[str, ...] = ("ok",)
    ) -> None:
        self.lenient = lenient
        # Every generation request behaves so, whatever its model (a backend beside good ones).
        self.behaviour = behaviour
        self.models = models
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.requests: Counter[str] = Counter()
        self.headers: list[dict[str, str]] = []
        # Bytes written per model and when the last write happened: tells whether the proxy kept
        # reading after its client left.
        self.written: Counter[str] = Counter()
        self.closed_at: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> HostileUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self._loop
        ).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        handlers = [task for task in asyncio.all_tasks() if task is not current]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                self.headers.append(headers)
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = await _read_chunked(reader)
                else:
                    body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "HEAD":  # an answer without a body, as HTTP has it
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                keep_open = await self._answer(method, path, body, writer)
                if not keep_open:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, model: str, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.written[model] += len(data)

    async def _answer(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path.rstrip("/").endswith("/health"):
            if self.behaviour == "hang":  # a stuck server: its health check hangs too
                await asyncio.sleep(3600)
            await self._respond(writer, 200, "application/json", b"")
            return True
        if method == "GET":
            models = {
                "object": "list",
                "data": [{"id": model, "object": "model", "max_model_len": 4096} for model in self.models],
            }
            await self._respond(writer, 200, "application/json", json.dumps(models).encode())
            return True
        try:
            request: Any = json.loads(body)
        except (ValueError, RecursionError):  # a passed-through body the proxy did not parse
            request = {}
        if not isinstance(request, dict):
            request = {}
        model = str(request.get("model"))
        if self.lenient and model not in BEHAVIOURS:
            model = "ok"
        if self.behaviour is not None:
            model = self.behaviour
        self.requests[model] += 1
        stream = request.get("stream") is True and path.endswith("/completions")
        try:
            return await self._behave(model, stream, writer, path)
        except ConnectionError:
            self.closed_at[model] = time.monotonic()
            return False

    async def _behave(self, model: str, stream: bool, writer: asyncio.StreamWriter, path: str = "") -> bool:
        if model == "drop":  # read the whole request, then hang up without a word
            return False
        if model == "hang":  # read the whole request, then never answer
            await asyncio.sleep(3600)
            return False
        if model == "cut":  # a stream's headers, then the connection closed before any event
            await self._start_chunked(writer, model, "text/event-stream" if stream else "application/json")
            return False
        if model == "cut-mid":  # two events of a stream, then the connection closed without its end
            await self._start_chunked(writer, model, "text/event-stream")
            await self._send(writer, model, _chunked(_chunk("a") + _chunk("b")))
            return False
        if model == "html-error":
            page = b"<html><body><h1>502</h1><pre>Traceback (most recent call last): secret.py</pre></body></html>"
            await self._respond(writer, 502, "text/html", page)
            return True
        if model == "not-json":
            await self._respond(writer, 200, "application/json", b"<html>surprise</html>")
            return True
        if model == "json-for-stream":  # ignores "stream": true
            await self._respond(writer, 200, "application/json", json.dumps(OK_CHAT).encode())
            return True
        if model in ("ok", "linger") and not stream:
            await self._respond(writer, 200, "application/json", json.dumps(_ok_body(path)).encode())
            return True
        if model == "drip":  # one byte every 0.3 s, for ever: every read is quick, the answer never ends
            await self._start_chunked(writer, model, "application/json" if not stream else "text/event-stream")
            while True:
                await self._send(writer, model, b"1\r\n \r\n")
                await asyncio.sleep(0.3)
        if model == "unterminated":  # `data: ` and then megabytes without the blank line ending the event
            await self._start_chunked(writer, model, "text/event-stream")
            await self._send(writer, model, _chunked(_chunk("first")))
            piece = _chunked(b"data: " + b"x" * 65536)
            while True:
                await self._send(writer, model, piece)
                await asyncio.sleep(0)
        if model == "malformed-chunk":
            await self._start_chunked(writer, model, "text/event-stream")
            await self._send(writer, model, _chunked(_chunk("a")))
            await self._send(writer, model, _chunked(b'data: {"usage":"x","choices":5}\n\n'))
            await self._send(writer, model, _chunked(b'data: {"choices":[{"delta":{"tool_calls":true}}]}\n\n'))
            await self._send(writer, model, _chunked(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[5]}}]}\n\n'))
            await self._send(writer, model, _chunked(_chunk("b")))
            await self._send(writer, model, _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True
        if model == "linger":  # a whole stream, [DONE] included, and the body's end a second later
            await self._start_chunked(writer, model, "text/event-stream")
            await self._send(writer, model, _chunked(_chunk("fine") + b"data: [DONE]\n\n"))
            await asyncio.sleep(1.0)
            await self._send(writer, model, b"0\r\n\r\n")
            return True
        if model == "ok":
            await self._start_chunked(writer, model, "text/event-stream")
            await self._send(writer, model, _chunked(_chunk("fine") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True
        await self._respond(writer, 404, "application/json", b'{"error": {"message": "no such model"}}')
        return True

    async def _respond(self, writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _start_chunked(self, writer: asyncio.StreamWriter, model: str, content_type: str) -> None:
        head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
        await self._send(writer, model, head.encode())


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked request body (what a streamed upload arrives as)."""
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)
