"""A streaming response that notices a client disconnect immediately, and ends at a deadline.

Starlette's StreamingResponse (ASGI spec >= 2.4) only learns of a disconnect
when its next write fails, which during a long prefill can be many seconds. The
upstream must be closed at once so vLLM frees the request's KV blocks, so this
response always races the body against ``http.disconnect``.

Read timeouts bound each wait for the upstream, not the whole answer: an
upstream that drips a byte now and then would hold the stream forever. The
``deadline`` bounds the whole response; past it the client gets an error event
and the upstream is closed.

``on_end`` is told how the stream ended; then ``background`` runs, as after any response, also
when the client left before the end (Starlette's own skips it then).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Literal

import anyio
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

# How a relayed stream ended, for ``on_end``: the body was sent to the end (which includes an
# upstream that failed and got its error event), the client left, or the deadline passed.
StreamEnd = Literal["sent", "disconnected", "deadline"]


class RelayResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterable[bytes],
        *,
        headers: dict[str, str],
        on_end: Callable[[StreamEnd], None] | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
        status_code: int = 200,
        deadline_s: float | None = None,
        deadline_event: bytes = b"",
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(
            content, status_code=status_code, headers=headers, media_type="text/event-stream", background=background
        )
        self._on_end = on_end
        self._close = close
        # Seconds the body may take from the moment the response starts being sent, and the last
        # bytes the client gets when they are up: its protocol's error event (ErrorDialect.stream_event).
        self._deadline_s = deadline_s
        self._deadline_event = deadline_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        end: StreamEnd = "sent"
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        # The body and the client's disconnect race as two tasks; the first to finish (or the
        # deadline) decides. Plain asyncio: the anyio task group and cancel scopes this replaced
        # cost a stream about 150 us of CPU, the two tasks about 30.
        relay = asyncio.ensure_future(self.stream_response(tracked_send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait((relay, watch), timeout=self._deadline_s, return_when=asyncio.FIRST_COMPLETED)
            if relay in done:
                try:
                    relay.result()
                except OSError:
                    end = "disconnected"
            else:
                await _stopped(relay)
                if watch in done:
                    watch.result()  # what reading the client raised, if anything, as the request's
                    end = "disconnected"
                else:
                    end = "deadline"
                    try:
                        await self._send_deadline_event(send, started)
                    except OSError:
                        end = "disconnected"
        finally:
            watch.cancel()
            if watch.done() and not watch.cancelled():
                watch.exception()  # retrieved (raised above where it decided the race)
            if not relay.done():  # this task was cancelled (the server is stopping): the body too
                await _stopped(relay)
            try:
                if self._close is not None:
                    # The body may never have been iterated (the client left before the headers went
                    # out), and then nothing else would close the upstream response.
                    with anyio.CancelScope(shield=True):
                        await self._close()
            finally:
                try:
                    if self._on_end is not None:
                        self._on_end(end)
                finally:
                    if self.background is not None:
                        # However the stream ended (the client gone included): what comes after
                        # every response, as after a whole one.
                        with anyio.CancelScope(shield=True):
                            await self.background()

    async def _send_deadline_event(self, send: Send, started: bool) -> None:
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self._deadline_event, "more_body": False})


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has left (``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stopped(task: asyncio.Future[None]) -> None:
    """Cancel ``task`` and wait until it has stopped (its exit steps run, the upstream response's
    among them). What it raised on its way out is not this task's concern; this task's own
    cancellation still reaches it."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved: asyncio logs a task's exception nobody retrieved
