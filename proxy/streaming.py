"""A streaming response that notices a client disconnect immediately.

Starlette's StreamingResponse (ASGI spec >= 2.4) only learns of a disconnect
when its next write fails, which during a long prefill can be many seconds. The
upstream must be closed at once so vLLM frees the request's KV blocks, so this
response always races the body against ``http.disconnect``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class RelayResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterable[bytes],
        *,
        headers: dict[str, str],
        on_finish: Callable[[bool], None],
        close: Callable[[], Awaitable[None]] | None = None,
        status_code: int = 200,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type="text/event-stream")
        self._on_finish = on_finish
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False

        async def watch_disconnect(cancel: anyio.CancelScope) -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    cancel.cancel()
                    return

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch_disconnect, group.cancel_scope)
                try:
                    await self.stream_response(send)
                except OSError:
                    disconnected = True
                group.cancel_scope.cancel()
        finally:
            try:
                if self._close is not None:
                    # The body may never have been iterated (the client left before the headers went
                    # out), and then nothing else would close the upstream response.
                    with anyio.CancelScope(shield=True):
                        await self._close()
            finally:
                self._on_finish(disconnected)
