"""Server-sent-events relay: forward each event as soon as it is complete.

Only events that carry usage or tool calls are parsed (or every event, when the
reply's text is wanted); everything else passes through as bytes. The proxy
always asks the upstream for usage, so the usage-only chunk is removed again
when the client did not ask for it.

An upstream is not trusted to behave: the buffer is scanned once per byte (an
event that never ends costs linear time, not a rescan per read), one event may
not grow past ``max_event_bytes``, and a chunk whose JSON has unexpected types
is relayed as it came rather than breaking the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from proxy.http.dialect import OPENAI, ErrorDialect
from proxy.openai.assistant import AssistantRecorder
from proxy.openai.jsonio import dumps, loads
from proxy.openai.usage import Usage

logger = logging.getLogger("prefix_proxy.relay")

_EVENT_END = b"\n\n"
_DONE = b"data: [DONE]"
_USAGE_MARK = b'"usage":'
_TOOL_MARK = b'"tool_calls"'
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024


def error_event(message: str, code: str) -> bytes:
    """An SSE event carrying an OpenAI-shaped error: OpenAI SDKs raise it as an APIError."""
    payload = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(payload).encode() + _EVENT_END


STREAM_INTERRUPTED_MESSAGE = "the upstream stream was interrupted"
STREAM_INTERRUPTED = error_event(STREAM_INTERRUPTED_MESSAGE, "upstream_stream_interrupted")


class SSERelay:
    """Relays one upstream SSE stream and collects what the proxy needs from it."""

    def __init__(
        self,
        response: httpx.Response,
        *,
        client_wants_usage: bool,
        on_first_chunk: Callable[[], None] | None = None,
        record_content: bool = False,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        dialect: ErrorDialect = OPENAI,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._response = response
        self._dialect = dialect
        self._client_wants_usage = client_wants_usage
        self._on_first_chunk = on_first_chunk
        self._max_event_bytes = max_event_bytes
        self.usage: Usage | None = None
        self.assistant = AssistantRecorder()
        self.completed = False
        # Events relayed so far: vLLM streams about one token per event, which is what a stream cut
        # short before its usage chunk is charged for.
        self.events = 0
        # Session inference needs the reply's text, which means parsing every event.
        self._record_content = record_content
        # Why the stream ended early ("interrupted", "event_too_large"), for the access log.
        self.failure: str | None = None
        # The whole answer, for protocols whose last event carries it (Responses' response.completed);
        # ``on_answer`` is told its header as soon as an event names it (Responses' response.created).
        self.answer: dict[str, Any] | None = None
        self._on_answer = on_answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pending = bytearray()
        # pending[:searched] holds no event end (all but its last byte, which may begin one).
        searched = 0
        held_cr = False
        first = True
        reads = 0
        try:
            async for raw in self._response.aiter_raw():
                # CRLF line ends become LF; a CR at the end of a read waits for the next one, which
                # may begin with the LF that completes it.
                if held_cr:
                    raw = b"\r" + raw
                held_cr = raw.endswith(b"\r")
                if held_cr:
                    raw = raw[:-1]
                if b"\r" in raw:
                    raw = raw.replace(b"\r\n", b"\n")
                pending += raw
                reads += 1
                cut = pending.rfind(_EVENT_END, max(0, searched - 1))
                if cut < 0:
                    searched = len(pending)
                    if len(pending) > self._max_event_bytes:
                        yield self._too_large()
                        return
                    # A read served from an already-full buffer does not suspend, and neither does
                    # this loop: an upstream writing faster than it is read would keep the event
                    # loop to itself (no other request served, the client's disconnect unseen).
                    await asyncio.sleep(0)
                    continue
                if reads % 32 == 0:
                    await asyncio.sleep(0)
                complete = bytes(pending[: cut + 2])
                del pending[: cut + 2]
                searched = len(pending)
                if len(pending) > self._max_event_bytes:
                    yield self._too_large()
                    return
                if self._wants(complete):
                    complete = self._inspect(complete)
                if complete:
                    if first and self._on_first_chunk is not None:
                        self._on_first_chunk()
                    first = False
                    self.events += complete.count(_EVENT_END)
                    if self._is_final(complete):
                        # The answer is whole once [DONE] is relayed: a client that hangs up at once
                        # must not race the upstream's end of body into an "incomplete" stream.
                        self.completed = True
                    yield complete
            if held_cr:
                pending += b"\r"
            if pending:
                yield bytes(pending)
            self.completed = True
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            # The upstream broke off mid-stream (crashed, restarted, timed out). The answer cannot be
            # resumed elsewhere; the client gets an error event, which OpenAI SDKs raise as an APIError,
            # rather than a connection that just stops.
            logger.warning("upstream stream interrupted: %s", type(exc).__name__)
            self.failure = "interrupted"
            yield self._dialect.stream_event(STREAM_INTERRUPTED_MESSAGE, "upstream_stream_interrupted")
        finally:
            await self._response.aclose()

    def _too_large(self) -> bytes:
        # An event this large is no token delta: a broken or hostile upstream. Buffering on would
        # cost memory without end; the stream is given up (the caller closes the upstream).
        logger.warning("upstream SSE event over %d bytes; stream abandoned", self._max_event_bytes)
        self.failure = "event_too_large"
        return self._dialect.stream_event(
            f"the upstream sent an event larger than {self._max_event_bytes} bytes", "upstream_event_too_large"
        )

    async def aclose(self) -> None:
        """Close the upstream response (idempotent): also when the body was never iterated, as when
        the client left before the response started."""
        await self._response.aclose()

    # -- what a protocol's relay overrides (chat completions here) ------------------------------

    def _wants(self, complete: bytes) -> bool:
        """Whether these complete events must be parsed (the rest pass through as bytes)."""
        return self._record_content or _USAGE_MARK in complete or _TOOL_MARK in complete

    def _is_final(self, complete: bytes) -> bool:
        """The answer is whole once these events are relayed."""
        return _DONE in complete

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
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                self.assistant.feed_delta(choice)
        usage = Usage.from_openai(chunk.get("usage"))
        if usage is None:
            return event
        self.usage = usage
        if self._client_wants_usage:
            return event
        if not choices:
            return None
        chunk.pop("usage", None)
        return b"data: " + dumps(chunk)
