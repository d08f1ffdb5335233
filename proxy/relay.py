"""Server-sent-events relay: forward each event as soon as it is complete.

Only events that carry usage or tool calls are parsed (or every event, when the
reply's text is wanted); everything else passes through as bytes. The proxy
always asks the upstream for usage, so the usage-only chunk is removed again
when the client did not ask for it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from proxy.assistant import AssistantRecorder
from proxy.jsonio import loads
from proxy.usage import Usage

logger = logging.getLogger("prefix_proxy.relay")

_EVENT_END = b"\n\n"
_DONE = b"data: [DONE]"
_STREAM_INTERRUPTED = (
    b'data: {"error": {"message": "the upstream stream was interrupted", "type": "upstream_error", '
    b'"param": null, "code": "upstream_stream_interrupted"}}\n\n'
)
_USAGE_MARK = b'"usage":'
_TOOL_MARK = b'"tool_calls"'


class SSERelay:
    """Relays one upstream SSE stream and collects what the proxy needs from it."""

    def __init__(
        self,
        response: httpx.Response,
        *,
        client_wants_usage: bool,
        on_first_chunk: Callable[[], None] | None = None,
        record_content: bool = False,
    ) -> None:
        self._response = response
        self._client_wants_usage = client_wants_usage
        self._on_first_chunk = on_first_chunk
        self.usage: Usage | None = None
        self.assistant = AssistantRecorder()
        self.completed = False
        # Events relayed so far: vLLM streams about one token per event, which is what a stream cut
        # short before its usage chunk is charged for.
        self.events = 0
        # Session inference needs the reply's text, which means parsing every event.
        self._record_content = record_content

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pending = b""
        first = True
        try:
            async for raw in self._response.aiter_raw():
                if b"\r" in raw:
                    raw = raw.replace(b"\r\n", b"\n")
                pending += raw
                cut = pending.rfind(_EVENT_END)
                if cut < 0:
                    continue
                complete, pending = pending[: cut + 2], pending[cut + 2 :]
                if self._record_content or _USAGE_MARK in complete or _TOOL_MARK in complete:
                    complete = self._inspect(complete)
                if complete:
                    if first and self._on_first_chunk is not None:
                        self._on_first_chunk()
                    first = False
                    self.events += complete.count(_EVENT_END)
                    if _DONE in complete:
                        # The answer is whole once [DONE] is relayed: a client that hangs up at once
                        # must not race the upstream's end of body into an "incomplete" stream.
                        self.completed = True
                    yield complete
            if pending:
                yield pending
            self.completed = True
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            # The upstream broke off mid-stream (crashed, restarted, timed out). The answer cannot be
            # resumed elsewhere; the client gets an error event, which OpenAI SDKs raise as an APIError,
            # rather than a connection that just stops.
            logger.warning("upstream stream interrupted: %s", type(exc).__name__)
            yield _STREAM_INTERRUPTED
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        """Close the upstream response (idempotent): also when the body was never iterated, as when
        the client left before the response started."""
        await self._response.aclose()

    def _inspect(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in block.split(_EVENT_END):
            if not event:
                continue
            if event.startswith(b"data: {") and (self._record_content or _USAGE_MARK in event or _TOOL_MARK in event):
                rewritten = self._inspect_event(event)
                if rewritten is None:
                    continue
                event = rewritten
            out.append(event + _EVENT_END)
        return b"".join(out)

    def _inspect_event(self, event: bytes) -> bytes | None:
        """Returns the event to forward (possibly rewritten), or None to drop it."""
        try:
            chunk: Any = loads(event[6:])
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        for choice in chunk.get("choices") or ():
            self.assistant.feed_delta(choice)
        usage = Usage.from_openai(chunk.get("usage"))
        if usage is None:
            return event
        self.usage = usage
        if self._client_wants_usage:
            return event
        if not chunk.get("choices"):
            return None
        chunk.pop("usage", None)
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
