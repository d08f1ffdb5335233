"""Deadlines on the way in (proxy/http/inbound.py): a request that does not arrive in time is cut, and
nothing else is.

The proxy runs as ``prefix-proxy serve`` runs it (a process of its own: uvicorn with the default HTTP
protocol, httptools), plus the same server on uvicorn's h11 protocol in a thread, with deadlines of a
second or two; the slow clients are raw sockets that stall or trickle. A deadline counts from the
connection's opening (the first request) or the request's first byte (a kept-alive connection).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import ValidationError

from proxy.app import create_app
from proxy.config import Settings
from proxy.http.inbound import EVICTABLE_AGE_S, InboundLimits
from proxy.serve import server_config
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import CHAT_PATH, MODEL, LiveServer, ProxyProcess, free_port

HEADER_S = 1.0
BODY_S = 2.0
SLACK_S = 0.75  # how late a cut may come (scheduling on a loaded CI machine); never early
STALLED_UPLOADS = int(os.environ.get("INBOUND_STALLED_UPLOADS", "300"))
JSON = {"content-type": "application/json"}
UPLOAD_PATH = "/v1/audio/transcriptions"  # a pass-through route: its body streams to the backend

DEADLINES = {
    "PREFIX_PROXY_REQUEST_HEADER_TIMEOUT_S": str(HEADER_S),
    "PREFIX_PROXY_REQUEST_BODY_TIMEOUT_S": str(BODY_S),
}


# -- servers ------------------------------------------------------------------------------------------


def upstream_app() -> Any:
    """The fake vLLM (chat streams at 60 ms a token), and a transcription route that reads its whole
    body before answering (as vLLM's does), for the pass-through upload."""
    fake = create_fake_app(FakeBackendConfig(seconds_per_output_token=0.06))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != UPLOAD_PATH:
            await fake(scope, receive, send)
            return
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"text": f"{size} bytes"}).encode()})

    return app


@pytest.fixture(scope="module")
def upstream() -> Iterator[LiveServer]:
    server = LiveServer(upstream_app(), name="upstream").start()
    yield server
    server.stop()


class ThreadServer:
    """The proxy's server (:func:`proxy.serve.server_config`) on uvicorn's h11 protocol, in a thread."""

    def __init__(self, settings: Settings) -> None:
        app = create_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(app, settings, app, http="h11", host="127.0.0.1", port=self.port, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "h11 server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


Server = ProxyProcess | ThreadServer


@pytest.fixture(scope="module")
def served(upstream: LiveServer) -> Iterator[ProxyProcess]:
    """``prefix-proxy serve`` with short deadlines (default cap on incomplete requests)."""
    proxy = ProxyProcess(upstream.url + "/v1", DEADLINES)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def h11_served(upstream: LiveServer) -> Iterator[ThreadServer]:
    server = ThreadServer(
        Settings(upstream=upstream.url + "/v1", request_header_timeout_s=HEADER_S, request_body_timeout_s=BODY_S)
    )
    yield server
    server.stop()


@pytest.fixture(params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Server:
    started: Server = request.getfixturevalue("served" if request.param == "httptools" else "h11_served")
    return started


def slow_clients(server: Server) -> dict[str, float]:
    """``prefix_proxy_slow_clients_total`` by reason."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {m[1]: float(m[2]) for m in re.finditer(r'prefix_proxy_slow_clients_total\{reason="(\w+)"\} (\S+)', text)}


def cut_since(before: dict[str, float], server: Server) -> dict[str, float]:
    after = slow_clients(server)
    return {reason: after[reason] - before.get(reason, 0.0) for reason in after}


# -- raw clients --------------------------------------------------------------------------------------


def head(path: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@dataclass
class Ending:
    """What a client saw: when the server closed the connection (seconds after it opened; None:
    still open when the wait ended), and the bytes it had sent by then."""

    after_s: float | None
    data: bytes

    @property
    def status(self) -> int | None:
        match = re.match(rb"HTTP/1\.1 (\d{3}) ", self.data)
        return int(match[1]) if match else None

    def header(self, name: str) -> str | None:
        head = self.data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        for line in head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None

    def json(self) -> Any:
        return json.loads(self.data.split(b"\r\n\r\n", 1)[1])


class Client:
    """A raw connection to the proxy, and when it was opened."""

    def __init__(self, server: Server, first: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port))
        self.opened = time.monotonic()
        self.data = b""
        self.closed_at: float | None = None
        if first:
            self.sock.sendall(first)

    def trickle(self, data: bytes, every_s: float) -> threading.Thread:
        """Send ``data`` a byte at a time, ``every_s`` apart, until done or the server closes."""

        def run() -> None:
            for byte in data:
                time.sleep(every_s)
                try:
                    self.sock.sendall(bytes([byte]))
                except OSError:
                    return

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def wait_closed(clients: list[Client], timeout_s: float) -> list[Ending]:
    """Read every client until the server closes it (or ``timeout_s`` passes); their endings, in order."""
    selector = selectors.DefaultSelector()
    for client in clients:
        client.sock.setblocking(False)
        selector.register(client.sock, selectors.EVENT_READ, client)
    open_count = len(clients)
    deadline = time.monotonic() + timeout_s
    while open_count and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            client = key.data
            try:
                chunk = client.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset: closed with the client's bytes unread
                chunk = b""
            if chunk:
                client.data += chunk
                continue
            client.closed_at = time.monotonic()
            selector.unregister(client.sock)
            open_count -= 1
    selector.close()
    endings = []
    for client in clients:
        client.sock.close()
        after = None if client.closed_at is None else client.closed_at - client.opened
        endings.append(Ending(after, client.data))
    return endings


def still_open(clients: list[Client]) -> list[bool]:
    """Whether the server still holds each connection (nothing to read, no end of stream)."""
    result = []
    for client in clients:
        client.sock.setblocking(False)
        try:
            result.append(client.sock.recv(1, socket.MSG_PEEK) != b"")
        except BlockingIOError:
            result.append(True)
        except OSError:
            result.append(False)
    return result


def assert_cut_at(ending: Ending, deadline_s: float, slack_s: float = SLACK_S) -> None:
    assert ending.after_s is not None, f"still open {deadline_s + slack_s + 1:.1f} s in; got {ending.data[:200]!r}"
    assert deadline_s - 0.05 <= ending.after_s <= deadline_s + slack_s, (ending.after_s, ending.data[:200])


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One whole response (with a content-length) from a blocking socket: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def chat_body(content: str = "hi", **fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}).encode()


# -- settings -----------------------------------------------------------------------------------------


def test_the_read_deadlines_never_exceed_the_request_deadline() -> None:
    assert InboundLimits.from_settings(Settings()) == InboundLimits(10.0, 60.0, 512)
    assert InboundLimits.from_settings(Settings(request_timeout_s=5)) == InboundLimits(5.0, 5.0, 512)
    for field in ("request_header_timeout_s", "request_body_timeout_s", "max_incomplete_requests"):
        with pytest.raises(ValidationError):
            Settings.model_validate({field: 0})


# -- the header deadline ------------------------------------------------------------------------------


def test_unfinished_headers_are_closed_at_the_header_deadline(server: Server) -> None:
    before = slow_clients(server)
    silent = Client(server)
    half = Client(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Le")
    trickled = Client(server, b"G")
    trickled.trickle(b"ET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n", every_s=0.2)  # 7 s of bytes

    endings = wait_closed([silent, half, trickled], timeout_s=HEADER_S + SLACK_S + 1)

    for ending in endings:
        assert_cut_at(ending, HEADER_S)
        assert ending.data == b""  # nothing was read that could be answered
    assert cut_since(before, server)["header_timeout"] == 3


# -- the request (body) deadline ----------------------------------------------------------------------


STALLED_BODIES = {CHAT_PATH: "openai", "/v1/messages": "anthropic", "/v1/tokenize": "openai"}  # the last passed through


def test_a_body_stalled_mid_upload_is_answered_408_at_the_deadline(server: Server) -> None:
    before = slow_clients(server)
    body = chat_body("a question that never ends")
    clients = [Client(server, head(path, len(body)) + body[:20]) for path in STALLED_BODIES]

    endings = wait_closed(clients, timeout_s=BODY_S + SLACK_S + 1)

    for ending, shape in zip(endings, STALLED_BODIES.values(), strict=True):
        assert_cut_at(ending, BODY_S)
        assert ending.status == 408, ending.data[:300]
        error = ending.json()
        if shape == "openai":
            assert error["error"]["code"] == "request_timeout"
        else:
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        if isinstance(server, ProxyProcess):  # h11 closes without saying so first
            assert ending.header("connection") == "close"
    assert cut_since(before, server)["body_timeout"] == len(clients)


def test_a_trickled_body_is_cut_at_the_deadline_each_byte_does_not_extend_it(server: Server) -> None:
    body = chat_body("x" * 200)
    client = Client(server, head(CHAT_PATH, len(body)) + body[:10])
    client.trickle(body[10:], every_s=0.5)  # 95 s of bytes at this rate

    [ending] = wait_closed([client], timeout_s=BODY_S + SLACK_S + 1)

    assert_cut_at(ending, BODY_S)
    assert ending.status == 408


def test_a_stalled_pass_through_upload_is_cut_at_the_deadline(served: ProxyProcess) -> None:
    """The multipart body streams to the backend as it arrives (routes/passthrough._Upload)."""
    before = slow_clients(served)
    client = Client(served, head(UPLOAD_PATH, 10_000, "multipart/form-data; boundary=b") + b"--b\r\n")

    [ending] = wait_closed([client], timeout_s=BODY_S + SLACK_S + 1)

    assert_cut_at(ending, BODY_S)
    assert ending.status is None or ending.status >= 400, ending.data[:300]
    assert cut_since(before, served)["body_timeout"] == 1


def test_a_stalled_pass_through_upload_is_answered_408(served: ProxyProcess) -> None:
    client = Client(served, head(UPLOAD_PATH, 10_000, "multipart/form-data; boundary=b") + b"--b\r\n")
    [ending] = wait_closed([client], timeout_s=BODY_S + SLACK_S + 1)
    assert ending.status == 408, ending.data[:300]


def test_a_request_that_nothing_reads_is_closed_when_its_body_is_late(served: ProxyProcess) -> None:
    """``GET /healthz`` announcing a body it never sends: answered at once (the route reads no body),
    then the connection is closed at the deadline instead of waiting for the rest."""
    client = Client(served, b"GET /healthz HTTP/1.1\r\nHost: proxy\r\nContent-Length: 1000\r\n\r\nabc")
    [ending] = wait_closed([client], timeout_s=BODY_S + SLACK_S + 1)
    assert ending.status == 200
    assert_cut_at(ending, BODY_S)


# -- many slow clients --------------------------------------------------------------------------------


class HealthProbe:
    """``GET /healthz`` on a new connection every 20 ms, in a thread: statuses (0: no answer) and
    latencies from connecting to the whole answer."""

    def __init__(self, server: Server) -> None:
        self.port = server.port
        self.results: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
                    status = read_response(sock)[0]
            except (OSError, AssertionError):
                status = 0
            self.results.append((status, time.monotonic() - started))
            self._stop.wait(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_stalled_uploads_are_all_closed_at_the_deadline_while_healthz_answers(served: ProxyProcess) -> None:
    """Slowloris: many uploads stalled mid-body. Each is answered 408 at its deadline (or, past the
    cap on incomplete requests, closed at once to make room); the server answers meanwhile."""
    before = slow_clients(served)
    body = chat_body("stalled")
    with HealthProbe(served) as probe:
        clients = [Client(served, head(CHAT_PATH, len(body)) + body[:30]) for _ in range(STALLED_UPLOADS)]
        endings = wait_closed(clients, timeout_s=BODY_S + SLACK_S + STALLED_UPLOADS / 1000 + 3)
    answered = [e for e in endings if e.status == 408]
    early = [e for e in endings if e.status is None]  # closed by the cap (only when over it)

    open_left = [e for e in endings if e.after_s is None]
    assert not open_left, f"{len(open_left)} of {len(endings)} stalled uploads still open"
    # The server's clock starts when it accepts a connection: a burst of them is accepted over up to
    # about a millisecond each (2 CPUs shared with the clients), which a client's clock also counts.
    burst_s = STALLED_UPLOADS / 1000
    for ending in answered:
        assert_cut_at(ending, BODY_S, SLACK_S + burst_s)
    assert len(answered) + len(early) == len(endings), {e.status for e in endings}
    cap = Settings().max_incomplete_requests
    assert len(early) <= max(0, STALLED_UPLOADS - cap) + len(probe.results)
    latencies = sorted(latency for _, latency in probe.results)
    assert len(latencies) >= 10 and {status for status, _ in probe.results} == {200}, probe.results
    cut = cut_since(before, served)
    assert cut["body_timeout"] == len(answered)
    lateness = [e.after_s - BODY_S for e in answered if e.after_s is not None]
    print(
        f"\n{len(endings)} stalled uploads: {len(answered)} answered 408 at {BODY_S} s"
        f" (+{min(lateness, default=0) * 1000:.0f}..+{max(lateness, default=0) * 1000:.0f} ms),"
        f" {len(early)} closed at once over the cap; /healthz {len(latencies)}x 200,"
        f" p50 {statistics.median(latencies) * 1000:.1f} ms,"
        f" p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )


@pytest.fixture(scope="module")
def capped(upstream: LiveServer) -> Iterator[ProxyProcess]:
    """Deadlines long enough that only the cap (20 incomplete requests) closes anything."""
    env = {
        "PREFIX_PROXY_REQUEST_HEADER_TIMEOUT_S": "30",
        "PREFIX_PROXY_REQUEST_BODY_TIMEOUT_S": "30",
        "PREFIX_PROXY_MAX_INCOMPLETE_REQUESTS": "20",
    }
    proxy = ProxyProcess(upstream.url + "/v1", env)
    yield proxy
    proxy.stop()


def test_past_the_cap_the_oldest_incomplete_request_is_closed_and_a_fast_one_gets_in(capped: ProxyProcess) -> None:
    before = slow_clients(capped)
    body = chat_body("stalled")
    stalled_heads = [Client(capped, b"POST /v1/chat/completions HTTP/1.1\r\nHost: p") for _ in range(10)]
    stalled_bodies = [Client(capped, head(CHAT_PATH, len(body)) + body[:30]) for _ in range(10)]
    oldest = stalled_heads + stalled_bodies
    newer: list[Client] = []
    try:
        time.sleep(EVICTABLE_AGE_S + 0.1)  # old enough to be cut (a burst's young ones never are)
        assert all(still_open(oldest))  # at the cap, not over it

        newer = [Client(capped, head(CHAT_PATH, len(body)) + body[:30]) for _ in range(20)]
        time.sleep(0.3)
        assert not any(still_open(oldest)), "the oldest 20 should have made room"
        assert all(still_open(newer))

        # A request that arrives at once is served: room is made for it (the oldest slow one goes).
        time.sleep(EVICTABLE_AGE_S)
        assert httpx.get(capped.url + "/healthz", timeout=5).status_code == 200
        time.sleep(0.1)
        assert still_open(newer) == [False] + [True] * 19
        with httpx.Client(base_url=capped.url, timeout=10) as http:  # there is room now
            response = http.post(CHAT_PATH, content=chat_body("hello", max_tokens=2), headers=JSON)
        assert response.status_code == 200, response.text

        cut = cut_since(before, capped)
        assert cut["too_many_incomplete"] == 21, cut
        assert cut["header_timeout"] == cut["body_timeout"] == 0
    finally:
        for client in oldest + newer:
            client.sock.close()


def test_a_burst_of_whole_requests_is_served_past_the_cap(capped: ProxyProcess) -> None:
    """asyncio accepts a burst of connections before it reads any: their requests are already in
    their buffers, and the cap must not cut them for being many at once."""
    request = b"GET /healthz HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
    clients = [Client(capped, request) for _ in range(60)]  # three times the cap of 20
    try:
        endings = wait_closed(clients, timeout_s=10)
        assert [e.status for e in endings] == [200] * 60
    finally:
        for client in clients:
            client.sock.close()


# -- what the deadlines do not touch ------------------------------------------------------------------


def test_the_deadline_is_on_the_request_not_the_answer(served: ProxyProcess) -> None:
    """A streamed answer outlives the deadlines (only the request's arrival is bounded), while a
    stalled upload beside it is cut at its deadline."""
    body = chat_body("a")
    stalled = Client(served, head(CHAT_PATH, len(body)) + body[:5])
    endings: list[Ending] = []
    watcher = threading.Thread(target=lambda: endings.extend(wait_closed([stalled], timeout_s=10)))
    watcher.start()
    started = time.monotonic()
    with (
        httpx.Client(base_url=served.url, timeout=30) as client,
        client.stream(
            "POST", CHAT_PATH, content=chat_body("Write an essay", stream=True, max_tokens=200), headers=JSON
        ) as response,
    ):
        assert response.status_code == 200
        lines = list(response.iter_lines())
    streamed_s = time.monotonic() - started

    assert "data: [DONE]" in lines, lines[-3:]
    assert streamed_s > BODY_S + 1, f"the stream took {streamed_s:.1f} s: too short to show anything"
    watcher.join()
    [ending] = endings
    assert ending.status == 408
    assert_cut_at(ending, BODY_S)


def test_a_kept_alive_connection_is_timed_per_request(server: Server) -> None:
    """Idle time between two requests is the keep-alive timeout's, not the header deadline's; a large
    body sent in pieces within the deadline is read whole; and a next request on the connection gets
    its own deadlines from its first byte (not from the connection's opening, long past)."""
    before = slow_clients(server)
    client = Client(server)
    sock = client.sock
    sock.settimeout(10)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert read_response(sock)[0] == 200
    time.sleep(HEADER_S + 0.5)  # longer than the header deadline, shorter than keep-alive (5 s)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert read_response(sock)[0] == 200

    body = chat_body("x" * 150_000, max_tokens=2)  # 150 KB in 30 pieces over ~0.9 s
    sock.sendall(head(CHAT_PATH, len(body)))
    for start in range(0, len(body), 5_000):
        time.sleep(0.03)
        sock.sendall(body[start : start + 5_000])
    status, answer = read_response(sock)
    assert status == 200, answer[:300]
    assert json.loads(answer)["choices"][0]["message"]["content"]
    assert time.monotonic() - client.opened > BODY_S + 0.5  # the connection outlived both deadlines
    assert cut_since(before, server) == {"header_timeout": 0, "body_timeout": 0, "too_many_incomplete": 0}

    client.opened = time.monotonic()
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # and no more
    [ending] = wait_closed([client], timeout_s=HEADER_S + SLACK_S + 1)
    assert_cut_at(ending, HEADER_S)
    assert ending.data == b""
    assert cut_since(before, server)["header_timeout"] == 1


class _Connection:
    """What Arrivals reads of a connection: its loop's clock, when its request started, cut()."""

    def __init__(self, arrivals: Any, clock: list[float]) -> None:
        self._arrivals, self._clock = arrivals, clock
        self._started = clock[0]
        self.reason: str | None = None
        self.loop = self

    def time(self) -> float:
        return self._clock[0]

    def cut(self, reason: str) -> None:
        self.reason = reason
        self._arrivals.leave(self)


def test_the_cap_never_cuts_a_connection_too_young_to_have_sent_its_request() -> None:
    from proxy.http.inbound import Arrivals

    cuts: list[str] = []
    arrivals = Arrivals(InboundLimits(header_timeout_s=10, body_timeout_s=30, max_incomplete=4), cuts.append)
    clock = [100.0]
    burst = [_Connection(arrivals, clock) for _ in range(12)]
    for connection in burst:  # accepted in one pass of the loop, none read yet
        arrivals.enter(connection)  # type: ignore[arg-type]
    assert [c.reason for c in burst] == [None] * 12
    clock[0] += EVICTABLE_AGE_S + 0.01  # still not in: slow clients now
    late = _Connection(arrivals, clock)
    arrivals.enter(late)  # type: ignore[arg-type]
    assert [c.reason for c in burst] == ["too_many_incomplete"] * 9 + [None] * 3
    assert late.reason is None
