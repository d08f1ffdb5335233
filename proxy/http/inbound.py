"""Deadlines on the way in: how long a client may take to send its request.

uvicorn bounds only the idle time between two requests of a kept-alive connection
(``timeout_keep_alive``): a connection that sends half a request line, or a body one byte at a
time, holds its socket (and, past the headers, an ASGI task) as long as the client likes
(slowloris). As a reverse proxy does (nginx's ``client_header_timeout`` / ``client_body_timeout``,
Envoy's ``request_headers_timeout``, Node's ``headersTimeout`` / ``requestTimeout``), the server's
HTTP protocol bounds that, with a clock per connection:

- **header deadline**: the request line and headers arrive within ``header_timeout_s`` of the
  request's start, or the connection is closed (nothing was read that could be answered);
- **request deadline**: the whole request, body included, arrives within ``body_timeout_s`` of
  its start; bytes trickling in do not extend it. Past it, a read of the body still waiting raises
  :class:`RequestTimeout` in the app (:class:`ReadDeadline`): answered 408 in the route's error
  shape, and the connection closed after it. A request nothing reads any more (its answer already
  under way or sent) is closed; one the app does not answer within :data:`ANSWER_GRACE_S` too;
- **a cap on arrivals**: at most ``max_incomplete`` connections whose request has not finished
  arriving (a new connection counts from its opening). One more and the oldest of them is closed,
  as nginx reclaims its connections still waiting for a request: a flood of slow clients can
  neither hold every descriptor nor lock out a client whose request arrives at once.

A request starts when its connection opens or, on a kept-alive connection, with its first byte.
Each cut is counted (``on_cut(reason)``: ``header_timeout``, ``body_timeout``,
``too_many_incomplete``). Nothing here touches the answer: a long stream is not limited.

A request that arrives whole in one read (the usual case) arms no timer of its own (a connection arms
one when it opens) and its app gets uvicorn's ``receive`` as it is.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.http.errors import RequestTimeout

if TYPE_CHECKING:
    from proxy.config import Settings

# How long the app has, once a request's deadline passed while nothing of its answer was sent, to
# answer it (the 408 of a read that was waiting); then the connection is closed regardless.
ANSWER_GRACE_S = 1.0

# In the scope of a request whose body is still arriving when its headers are in: ARRIVING, then
# EXPIRED once its deadline passed; removed when the body is complete. No key: nothing to bound.
ARRIVAL_KEY = "prefix_proxy.arrival"
ARRIVING = "arriving"
EXPIRED = "expired"

# A connection's phase: between requests, reading a request's head, reading its body, closed.
_IDLE, _HEADERS, _BODY, _CLOSED = range(4)


@dataclass(frozen=True)
class InboundLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_incomplete: int

    @classmethod
    def from_settings(cls, settings: Settings) -> InboundLimits:
        """The configured limits; neither deadline exceeds the request's overall ``request_timeout_s``."""
        overall = settings.request_timeout_s
        return cls(
            header_timeout_s=min(settings.request_header_timeout_s, overall),
            body_timeout_s=min(settings.request_body_timeout_s, overall),
            max_incomplete=settings.max_incomplete_requests,
        )


# How old a connection still arriving must be before the cap may cut it.
EVICTABLE_AGE_S = 1.0


class Arrivals:
    """The connections of one server whose request has not finished arriving, oldest first."""

    def __init__(self, limits: InboundLimits, on_cut: Callable[[str], None]) -> None:
        self.limits = limits
        self.on_cut = on_cut
        self._waiting: OrderedDict[_Deadlines, None] = OrderedDict()  # O(1) at both ends

    def enter(self, connection: _Deadlines) -> None:
        waiting = self._waiting
        waiting[connection] = None
        if len(waiting) <= self.limits.max_incomplete:
            return
        # Only a connection that has had time to send its request is cut: asyncio accepts a whole
        # burst of connections before it reads any of them, and those requests are already in
        # their sockets' buffers. Past the cap by at most what arrives within EVICTABLE_AGE_S.
        evictable_before = connection.loop.time() - min(EVICTABLE_AGE_S, self.limits.header_timeout_s / 4)
        while len(waiting) > self.limits.max_incomplete:
            oldest = next(iter(waiting))
            if oldest._started > evictable_before:
                break
            oldest.cut("too_many_incomplete")  # leaves ``waiting``

    def leave(self, connection: _Deadlines) -> None:
        self._waiting.pop(connection, None)


class _Deadlines(asyncio.Protocol):
    """The deadlines, over one of uvicorn's HTTP/1.1 protocols (the class after this one in the MRO).

    The parser's callbacks move ``_phase``; the timer follows the phase after each read
    (:meth:`_sync_timer`), so a request whose head and body come in one read arms none.
    """

    arrivals: ClassVar[Arrivals]
    # uvicorn's own attributes, set by the protocol this class is mixed into.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    _phase = _IDLE
    _started = 0.0  # loop time the current request started
    _timer: asyncio.TimerHandle | None = None
    _timer_phase = _IDLE

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin()
        self._sync_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._detach()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_timer()

    def _begin(self) -> None:
        """A request starts: the connection opened, or a kept-alive one received a first byte."""
        self._phase = _HEADERS
        self._started = self.loop.time()
        self.arrivals.enter(self)

    def _headers_in(self) -> None:
        """The request's head is in; its body is not (yet)."""
        self._phase = _BODY
        self.cycle.scope[ARRIVAL_KEY] = ARRIVING

    def _arrived(self) -> None:
        """The request is in, body included."""
        self._phase = _IDLE
        self.arrivals.leave(self)
        if self.cycle is not None:
            self.cycle.scope.pop(ARRIVAL_KEY, None)

    def _detach(self) -> None:
        self._phase = _CLOSED
        self.arrivals.leave(self)
        self._sync_timer()

    def _sync_timer(self) -> None:
        phase = self._phase
        if phase == self._timer_phase:
            return
        self._timer_phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        limits = self.arrivals.limits
        if phase == _HEADERS:
            self._timer = self.loop.call_at(self._started + limits.header_timeout_s, self._expired)
        elif phase == _BODY:
            self._timer = self.loop.call_at(self._started + limits.body_timeout_s, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self._phase == _HEADERS:
            self.cut("header_timeout")
            return
        cycle = self.cycle
        scope = cycle.scope
        if scope.get(ARRIVAL_KEY) == EXPIRED:  # the grace to answer it is over
            self.cut(None)
            return
        if cycle.response_started:
            self.cut("body_timeout")
            return
        # A read waiting for the body raises RequestTimeout (ReadDeadline); the answer closes the
        # connection. Woken now, a read pending returns at once.
        scope[ARRIVAL_KEY] = EXPIRED
        cycle.keep_alive = False
        cycle.message_event.set()
        self.arrivals.on_cut("body_timeout")
        self._timer = self.loop.call_later(ANSWER_GRACE_S, self._expired)

    def cut(self, reason: str | None) -> None:
        """Close the connection: its request did not arrive in time (``reason`` counted)."""
        self._detach()
        if reason is not None:
            self.arrivals.on_cut(reason)
        if not self.transport.is_closing():
            self.transport.close()


class HttpToolsDeadlines(_Deadlines, HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase == _IDLE:
            self._begin()

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:  # not an upgrade (which makes none)
            self._headers_in()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._arrived()

    def handle_websocket_upgrade(self) -> None:
        self._detach()
        super().handle_websocket_upgrade()


class H11Deadlines(_Deadlines, H11Protocol):
    """h11 has no callbacks: the phase is read from its state after each batch of events."""

    def handle_events(self) -> None:
        super().handle_events()
        phase = self._phase
        if phase == _CLOSED:
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if phase == _IDLE and self.conn.trailing_data[0]:
                self._begin()  # a next request's first bytes
        elif state is h11.SEND_BODY:
            if phase != _BODY:
                if phase == _IDLE:
                    self._begin()
                self._headers_in()
        elif phase != _IDLE and self.cycle is not None:  # DONE, MUST_CLOSE, ...: all of it is in
            self._arrived()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._detach()
        super().handle_websocket_upgrade(event)


def deadline_protocol(
    limits: InboundLimits, on_cut: Callable[[str], None], http: Literal["auto", "httptools", "h11"] = "auto"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``http`` (``auto``: the one uvicorn's ``auto`` picks) with the deadlines,
    for one server's ``uvicorn.Config(http=...)``: each call is a class of its own, with its own arrivals."""
    if http == "auto":
        http = "httptools" if issubclass(AutoHTTPProtocol, HttpToolsProtocol) else "h11"
    base = HttpToolsDeadlines if http == "httptools" else H11Deadlines
    return type(base.__name__, (base,), {"arrivals": Arrivals(limits, on_cut)})


def bounded_receive(scope: Scope, receive: Receive) -> Receive:
    """``receive``, raising :class:`RequestTimeout` for a read of the body past the request's deadline
    (for a request whose scope :func:`deadline_protocol` marked: ``ARRIVAL_KEY in scope``)."""

    async def bounded() -> Message:
        message = await receive()
        if message.get("more_body") and scope.get(ARRIVAL_KEY) == EXPIRED:
            raise RequestTimeout()
        return message

    return bounded


class ReadDeadline:
    """ASGI middleware: a read of the body past the request's deadline raises :class:`RequestTimeout`.

    The clock is the server's (:func:`deadline_protocol`, which marks the scope); under any other
    server, or for a request already in when the app starts, the app gets ``receive`` untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if ARRIVAL_KEY in scope:
            receive = bounded_receive(scope, receive)
        await self.app(scope, receive, send)
