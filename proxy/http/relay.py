"""Server-sent-events relay: forward each event as soon as it is complete.

Only events that carry usage or tool calls are parsed (or every event, when the
reply's text is wanted); everything else passes through as bytes. The proxy
always asks the upstream for usage, so the usage-only chunk is removed again
when the client did not ask for it.

An upstream is not trusted to behave: the buffer is scanned once per byte (an
event that never ends costs linear time, not a rescan per read), one event may
not grow past ``max_event_bytes``, and a chunk whose JSON has unexpected types
is relayed as it came rather than breaking the stream. What is not the protocol
at all ends the stream with an error event in the protocol's shape: an event
whose data is not a JSON object (or ``[DONE]``), a line that is no SSE field, a
stream that ends before the protocol's last event. Each event is checked by its
first and last bytes as it passes (no parse); only an odd one is looked at
closer. Error events are scrubbed of the credentials the proxy sent upstream.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import httpx

from proxy.http.dialect import OPENAI, ErrorDialect
from proxy.openai import AssistantRecorder, Usage, dumps, loads

logger = logging.getLogger("prefix_proxy.relay")

_EVENT_END = b"\n\n"
_DONE_DATA = b"[DONE]"
_USAGE_MARK = b'"usage":'
_TOOL_MARK = b'"tool_calls"'
# In every error event of every protocol ({"error": ...}, {"type": "error"}, "event: error").
_ERROR_MARK = b"error"
_CLOSE_BRACE = ord("}")
# A line no protocol the relay serves sends: data that is neither a JSON object nor [DONE], or
# no SSE field at all (blank lines aside).
_FOREIGN_LINE = re.compile(rb"^(?!(?:data: ?(?:\{.*\}|\[DONE\])|event:.*|id:.*|retry:.*|:.*|)[ \t]*$)", re.MULTILINE)
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024


STREAM_INTERRUPTED_MESSAGE = "the upstream stream was interrupted"
# A stream that is not the protocol (see the module doc); the code of a whole answer that is not.
INVALID_RESPONSE_CODE = "upstream_invalid_response"
# Why a stream ended early because of what the upstream sent (``SSERelay.failure``).
PROTOCOL_FAILURES = frozenset({"invalid_event", "truncated"})


def well_formed(events: bytes) -> bool:
    """Whether complete events (each ending in a blank line) are SSE as the protocols send it.

    One event of one ``data: {...}`` line, or ``event: NAME`` and such a line, is told by a few
    byte comparisons; anything else by a scan of its lines."""
    end = len(events) - 2
    first = events.find(b"\n")
    if first == end:
        if events.startswith(b"data: {") and events[end - 1] == _CLOSE_BRACE:
            return True
    elif (
        events.startswith(b"event: ")
        and events.startswith(b"data: {", first + 1)
        and events.find(b"\n", first + 1) == end
        and events[end - 1] == _CLOSE_BRACE
    ):
        return True
    return _FOREIGN_LINE.search(events) is None


class Fields(NamedTuple):
    """An SSE event's ``event`` and ``data`` fields."""

    name: bytes | None
    data: bytes | None

    def json(self) -> Any:
        """The data as JSON; None where it is none."""
        if self.data is None:
            return None
        try:
            return loads(self.data)
        except ValueError:
            return None


def fields(event: bytes) -> Fields:
    """One event's fields as an SSE client reads them (WHATWG's event stream interpretation): each
    line a field, one space after its colon optional, ``data`` lines joined by newlines, comments
    (``:``) and other fields passed over. What the proxy decides about an event (its end, an error)
    reads these, never a search of its bytes, which would find the same words in the model's text."""
    name: bytes | None = None
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value
    return Fields(name, b"\n".join(data) if data else None)


def events_of(block: bytes) -> list[bytes]:
    """The events of a block of complete events (each ends in a blank line), blank ones left out."""
    return [event for event in block.split(_EVENT_END) if event]


def final_event(block: bytes, names: frozenset[bytes]) -> bool:
    """Whether an event of ``block`` is named one of ``names`` (its ``event:`` field, else the
    ``type`` of its JSON data, as Anthropic's and Responses' events carry both). Only an event that
    holds one of the names is read (looked for in C first: most blocks hold none)."""
    if not any(name in block for name in names):
        return False
    for event in events_of(block):
        if not any(name in event for name in names):
            continue
        read = fields(event)
        if read.name is not None:
            if read.name in names:
                return True
            continue
        payload = read.json()
        kind = payload.get("type") if isinstance(payload, dict) else None
        if isinstance(kind, str) and kind.encode("utf-8", "surrogatepass") in names:
            return True
    return False


def is_error_event(event: bytes) -> bool:
    """An event that reports an error in any protocol's shape (OpenAI's, vLLM's, Anthropic's,
    Responses', llama-server's ``event: error`` whatever its data)."""
    read = fields(event)
    if read.name == b"error":
        return True
    payload = read.json()
    if not isinstance(payload, dict):
        return False
    return isinstance(payload.get("error"), dict) or payload.get("type") == "error" or payload.get("object") == "error"


# A field line written without the space after its colon (``data:{...}``), which SSE allows.
_UNSPACED_FIELD = re.compile(rb"^(data|event):(?! )", re.MULTILINE)


def spaced(block: bytes) -> bytes:
    """``block`` with a space after every ``data:`` and ``event:`` field's colon: the same events to
    any SSE client, in the one form every check of the relay reads (``data: {``)."""
    return _UNSPACED_FIELD.sub(rb"\1: ", block) if _UNSPACED_FIELD.search(block) else block


class EventData(NamedTuple):
    """An SSE event's JSON object data, and where its ``data: `` line is in the event."""

    payload: dict[str, Any]
    start: int
    end: int

    def replaced(self, event: bytes, payload: dict[str, Any]) -> bytes:
        """``event`` with ``payload`` as its data (its other lines as they were)."""
        return event[: self.start] + b"data: " + dumps(payload) + event[self.end :]


def event_data(event: bytes) -> EventData | None:
    """The JSON object an event's ``data: `` line holds; None when it holds none."""
    start = event.find(b"data: {")
    if start < 0:
        return None
    end = event.find(b"\n", start)
    end = len(event) if end < 0 else end
    try:
        payload: Any = loads(event[start + 6 : end])
    except ValueError:
        return None
    return EventData(payload, start, end) if isinstance(payload, dict) else None


def with_data_fields(event: bytes, target: Callable[[dict[str, Any]], Any], fields: dict[str, Any]) -> bytes | None:
    """The event with ``fields`` added to the object ``target`` picks out of its JSON data (the
    other lines, and the rest of the data, as they were re-serialized); None when it has none."""
    data = event_data(event)
    found = target(data.payload) if data is not None else None
    if data is None or not isinstance(found, dict):
        return None
    found.update(fields)
    return data.replaced(event, data.payload)


def _until_foreign(complete: bytes) -> bytes:
    """The events before the first that is not :func:`well_formed`."""
    good: list[bytes] = []
    for event in complete.split(_EVENT_END)[:-1]:
        if not event:
            continue
        if not well_formed(event + _EVENT_END):
            break
        good.append(event + _EVENT_END)
    return b"".join(good)


class SSERelay:
    """Relays one upstream SSE stream and collects what the proxy needs from it."""

    def __init__(
        self,
        response: httpx.Response,
        *,
        client_wants_usage: bool,
        record_content: bool = False,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        dialect: ErrorDialect = OPENAI,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
        scrub: Callable[[bytes], bytes] | None = None,
        answer_fields: dict[str, Any] | None = None,
    ) -> None:
        self._response = response
        self._dialect = dialect
        self._client_wants_usage = client_wants_usage
        # When the first event went to the client (the time to first token, read at the end).
        self.first_event_at: float | None = None
        self._max_event_bytes = max_event_bytes
        # Removes the credentials the proxy sent upstream from an error event before it is relayed.
        self._scrub = scrub
        self._usage: Usage | None = None
        # The upstream reported usage that could not be true (see ``usage``).
        self.usage_rejected = False
        # The upstream sent an error event of its own.
        self.upstream_error = False
        self.assistant = AssistantRecorder()
        self.completed = False
        # Awaited once the protocol's last event has been read, before it goes to the client: a
        # client may send its next request the moment it has that event (naming this answer, or
        # extending this conversation), before the response's end reaches the proxy's own code.
        self.before_last_event: Callable[[], Awaitable[None]] | None = None
        self._last_event_told = False
        # Events relayed so far: vLLM streams about one token per event, which is what a stream cut
        # short before its usage chunk is charged for.
        self.events = 0
        # Session inference needs the reply's text, which means parsing every event.
        self._record_content = record_content
        # Why the stream ended early, for the access log: "interrupted", "event_too_large", or what
        # the upstream sent was not the protocol (PROTOCOL_FAILURES), or it ended after an error
        # event of its own ("upstream_error").
        self.failure: str | None = None
        # The whole answer, for protocols whose last event carries it (Responses' response.completed);
        # ``on_answer`` is told its header as soon as an event names it (Responses' response.created).
        self.answer: dict[str, Any] | None = None
        self._on_answer = on_answer
        # The backend's id of the answer, once an event names it.
        self.answer_id: str | None = None
        # Fields the proxy adds to the answer object at the client's request (cache diagnostics),
        # in the event that carries it (``_annotate``); None once added.
        self._answer_fields = answer_fields

    @property
    def usage(self) -> Usage | None:
        """The upstream's last usage report that could be true; what a protocol's reader makes of
        a nonsense block (no prompt, counts past any context) is not kept: the turn is then charged
        its estimate, never 0."""
        return self._usage

    @usage.setter
    def usage(self, usage: Usage | None) -> None:
        if usage is not None and not usage.plausible:
            self.usage_rejected = True
            return
        self._usage = usage

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pending = bytearray()
        # pending[:searched] holds no event end (all but its last byte, which may begin one).
        searched = 0
        held_cr = False
        first = True
        reads = 0
        try:
            async for raw in self._body():
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
                complete = self._relay(complete)
                if complete:
                    if first:
                        self.first_event_at = time.perf_counter()
                    first = False
                    await self._tell_last_event()
                    yield complete
                if self.failure is not None:
                    yield self._invalid_event()
                    return
            if held_cr:
                pending += b"\r"
            # After the last blank line: an event the upstream did not end. Only the protocol's last
            # one is relayed (ended for it); any other is dropped, as an SSE client drops it.
            tail = bytes(pending).rstrip(b"\n")
            if tail and not self.completed and self._is_final(tail):
                complete = self._relay(tail + _EVENT_END)
                if complete:
                    await self._tell_last_event()
                    yield complete
                if self.failure is not None:
                    yield self._invalid_event()
                    return
            # A protocol relay that read the whole answer from the last event has seen the end, even
            # where that event came without the ``event:`` line ``_is_final`` looks for.
            if self.answer is not None:
                self.completed = True
            if not self.completed:
                truncated = self._truncated()
                if truncated:
                    yield truncated
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            # The upstream broke off mid-stream (crashed, restarted, timed out). The answer cannot be
            # resumed elsewhere; the client gets an error event, which OpenAI SDKs raise as an APIError,
            # rather than a connection that just stops.
            logger.warning("upstream stream interrupted: %s", type(exc).__name__)
            self.failure = "interrupted"
            yield self._dialect.stream_event(STREAM_INTERRUPTED_MESSAGE, "upstream_stream_interrupted")
        finally:
            await self._response.aclose()

    def _body(self) -> AsyncIterator[bytes]:
        """The upstream's body as it comes, decoded where it came encoded (the proxy asks for it as it
        is; an intermediary may compress text/* anyway): the events are read, and relayed as text."""
        encoding = self._response.headers.get("content-encoding", "").strip().lower()
        return self._response.aiter_bytes() if encoding not in ("", "identity") else self._response.aiter_raw()

    async def _tell_last_event(self) -> None:
        if self.completed and not self._last_event_told:
            self._last_event_told = True
            if self.before_last_event is not None:
                try:
                    await self.before_last_event()
                except Exception:  # the answer still reaches the client whole
                    logger.exception("recording a streamed answer before its last event failed")

    def _relay(self, complete: bytes) -> bytes:
        """What to relay of these complete events (setting ``failure`` at the first that is not the
        protocol: the ones before it are relayed, the rest never)."""
        complete = spaced(complete)
        if _ERROR_MARK in complete:
            if self._scrub is not None:
                complete = self._scrub(complete)
            if any(is_error_event(event) for event in events_of(complete) if _ERROR_MARK in event):
                self.upstream_error = True
        foreign = not well_formed(complete)
        if foreign:
            complete = _until_foreign(complete)
        if self._wants(complete):
            complete = self._inspect(complete)
        if self._answer_fields is not None:
            complete = self._annotate(complete)
        self.events += complete.count(_EVENT_END)
        if self._is_final(complete) and not self.upstream_error:
            # The answer is whole once [DONE] is relayed: a client that hangs up at once must not
            # race the upstream's end of body into an "incomplete" stream. Not after an error event
            # of the upstream's own (vLLM sends [DONE] after one): that answer is not whole.
            self.completed = True
        if foreign:
            logger.warning("upstream sent an SSE event that is not the protocol's; stream ended")
            self.failure = "invalid_event"
        return complete

    def _invalid_event(self) -> bytes:
        return self._dialect.stream_event("the upstream sent an event that is not JSON", INVALID_RESPONSE_CODE)

    def _truncated(self) -> bytes:
        """The upstream's body ended before the protocol's last event: the client is told, unless the
        upstream already said why in an error event of its own."""
        if self.upstream_error:
            self.failure = "upstream_error"
            return b""
        logger.warning("upstream stream ended before its last event")
        self.failure = "truncated"
        return self._dialect.stream_event(
            "the upstream stream ended before the answer did", "upstream_stream_truncated"
        )

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
        """The answer is whole once these events are relayed: an event whose data is ``[DONE]``."""
        return _DONE_DATA in complete and any(fields(event).data == _DONE_DATA for event in events_of(complete))

    def _inspect(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in block.split(_EVENT_END):
            if not event:
                continue
            if event.startswith(b"data: {") and (self._record_content or _USAGE_MARK in event or _TOOL_MARK in event):
                rewritten = self._inspect_event(event)
                if self.failure is not None:
                    break
                if rewritten is None:
                    continue
                event = rewritten
            out.append(event + _EVENT_END)
        return b"".join(out)

    def _annotate(self, block: bytes) -> bytes:
        """Add the answer fields to the first chunk (chat completions: each chunk is the answer
        object so far, and SDKs keep the first chunk's extra fields)."""
        fields = self._answer_fields
        out: list[bytes] = []
        for event in block.split(_EVENT_END):
            if not event:
                continue
            if fields is not None and event.startswith(b"data: {"):
                rewritten = with_data_fields(event, lambda payload: payload, fields)
                if rewritten is not None:
                    event, fields = rewritten, None
            out.append(event + _EVENT_END)
        self._answer_fields = fields
        return b"".join(out)

    def _inspect_event(self, event: bytes) -> bytes | None:
        """Returns the event to forward (possibly rewritten), or None to drop it."""
        try:
            chunk: Any = loads(event[6:])
        except ValueError:
            self.failure = "invalid_event"  # looked like a JSON object, is none: the stream ends
            return None
        if not isinstance(chunk, dict):
            return event
        if self.answer_id is None and isinstance(chunk.get("id"), str):
            self.answer_id = chunk["id"]
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                self.assistant.feed_delta(choice)
        reported = chunk.get("usage")
        usage = Usage.from_openai(reported)
        if usage is None:
            if reported is not None:
                self.usage_rejected = True
            return event
        self.usage = usage
        # What the proxy's own include_usage made the engine send is the usage-only chunk (no
        # choices), dropped for a client that did not ask; usage an engine sends on a chunk of the
        # answer without being asked (llama-server's last chunk) is the engine's, relayed as it came.
        if self._client_wants_usage or choices:
            return event
        return None
