"""One JSON line per request, without prompt text unless asked for; x-request-id end to end."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator

import httpx
import pytest

from proxy.http.context import RequestContext
from proxy.observability.access_log import (
    ACCESS_LOGGER,
    JsonFormatter,
    JsonLinesHandler,
    configure_logging,
    log_request,
)
from proxy.openai.usage import Usage
from tests.helpers import LiveServer

SECRET = "my password is hunter2"


def send(server: LiveServer) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 5}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-abc-123"})


def test_one_json_line_per_request_without_prompt_text(proxy: LiveServer, access_lines: list[str]) -> None:
    response = send(proxy)
    assert response.headers["x-request-id"] == "req-abc-123"
    (line,) = [json.loads(x) for x in access_lines if "req-abc-123" in x]
    assert line["route"] == "chat" and line["status"] == 200 and line["model"] == "fake-model"
    assert line["tenant"] == "anonymous" and line["prompt_tokens"] > 0 and "cached_tokens" in line
    assert isinstance(line["actions"], list) and line["overhead_ms"] >= 0
    assert SECRET not in "".join(access_lines)


def test_request_id_reaches_the_upstream(proxy: LiveServer, fake_backend: LiveServer) -> None:
    send(proxy)
    logged = httpx.get(fake_backend.url + "/fake/requests", params={"limit": 5}).json()
    assert any(r["headers"].get("x-request-id") == "req-abc-123" for r in logged)


def test_prompts_logged_only_when_enabled(make_proxy: Callable[..., LiveServer], access_lines: list[str]) -> None:
    send(make_proxy(log_prompts=True))
    assert SECRET in "".join(access_lines)


def test_timestamps_are_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        record = logging.LogRecord("prefix_proxy.access", logging.INFO, __file__, 1, "request", None, None)
        record.created, record.msecs = 86_400.25, 250.0
        assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-02T00:00:00.250Z"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.fixture
def proxy_logging() -> Iterator[io.StringIO]:
    """The logging the proxy's CLI configures, writing into a buffer."""
    root = logging.getLogger("prefix_proxy")
    saved = (root.handlers[:], root.level, root.propagate)
    stream = io.StringIO()
    configure_logging("info")
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    yield stream
    root.handlers[:], root.level, root.propagate = saved


def answered_context() -> RequestContext:
    ctx = RequestContext(route="chat", request_id="req-1", model="m", tenant="anonymous", status=200)
    ctx.usage = Usage(prompt_tokens=80, completion_tokens=5, cached_tokens=64)
    ctx.actions = ["volatile_moved:date"]
    return ctx


# The access line of answered_context(), after its "ts": every field, in this order.
ANSWERED_LINE = (
    '"level":"info","logger":"prefix_proxy.access","event":"request","request_id":"req-1","route":"chat",'
    '"status":200,"model":"m","tenant":"anonymous","stream":false,"session":null,"prefix":null,"backend":null,'
    '"prompt_tokens":80,"cached_tokens":64,"completion_tokens":5,"actions":["volatile_moved:date"],"overhead_ms":1.25}'
)


def without_ts(line: str) -> str:
    ts, rest = line.split(",", 1)
    assert ts.startswith('{"ts":"') and ts.endswith('Z"'), line
    return rest


def test_the_access_line_is_the_same_under_the_proxys_handler_and_a_users(proxy_logging: io.StringIO) -> None:
    """``prefix-proxy serve`` installs the proxy's handler; an application that embeds the proxy
    installs its own (here: a plain StreamHandler with the proxy's formatter). Same line."""
    root = logging.getLogger("prefix_proxy")
    # pytest attaches its capture handlers to non-propagating loggers: not part of either setup.
    root.handlers[:] = [h for h in root.handlers if isinstance(h, JsonLinesHandler)]
    log_request(answered_context(), 1.25)
    proxys = proxy_logging.getvalue().splitlines()

    users_stream = io.StringIO()
    users = logging.StreamHandler(users_stream)
    users.setFormatter(JsonFormatter())
    root.handlers[:] = [users]
    log_request(answered_context(), 1.25)
    users_lines = users_stream.getvalue().splitlines()

    assert len(proxys) == len(users_lines) == 1
    assert without_ts(proxys[0]) == without_ts(users_lines[0]) == ANSWERED_LINE


def test_what_is_added_to_the_loggers_after_configure_logging_sees_every_line(proxy_logging: io.StringIO) -> None:
    """Nothing about the loggers is decided once: a filter or a handler added to the access logger
    after the proxy configured logging gets each line (and a filter can still drop one)."""
    access = logging.getLogger(ACCESS_LOGGER)
    seen: list[logging.LogRecord] = []
    capture_stream = io.StringIO()
    capture = logging.StreamHandler(capture_stream)
    capture.setFormatter(JsonFormatter())
    access.addFilter(lambda record: seen.append(record) or record.fields["request_id"] != "dropped")  # type: ignore[attr-defined]
    access.addHandler(capture)
    try:
        log_request(answered_context(), 1.25)
        dropped = answered_context()
        dropped.request_id = "dropped"
        log_request(dropped, 1.25)
    finally:
        access.filters.clear()
        access.removeHandler(capture)
    assert len(seen) == 2
    assert [without_ts(line) for line in capture_stream.getvalue().splitlines()] == [ANSWERED_LINE]
    assert [without_ts(line) for line in proxy_logging.getvalue().splitlines()] == [ANSWERED_LINE]


def test_a_failing_log_stream_is_reported_not_raised_into_the_request(
    proxy_logging: io.StringIO, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger("prefix_proxy")
    root.handlers[:] = [h for h in root.handlers if isinstance(h, JsonLinesHandler)]
    proxy_logging.close()
    log_request(answered_context(), 1.25)  # does not raise
    assert "--- Logging error ---" in capsys.readouterr().err


def test_the_proxys_own_handler_alone_gets_the_line_without_a_record(
    proxy_logging: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the proxy's handler is the only one the line reaches, it is written without a
    LogRecord (what the records cost is most of an access line's): the same line; any filter or
    other handler configured puts it back through logging."""
    root = logging.getLogger("prefix_proxy")
    root.handlers[:] = [h for h in root.handlers if isinstance(h, JsonLinesHandler)]
    made: list[logging.LogRecord] = []
    make_record = logging.Logger.makeRecord

    def counted(self: logging.Logger, *args: object, **kwargs: object) -> logging.LogRecord:
        made.append(make_record(self, *args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(logging.Logger, "makeRecord", counted)
    log_request(answered_context(), 1.25)
    assert made == []
    root.handlers[0].addFilter(lambda record: True)
    log_request(answered_context(), 1.25)
    assert len(made) == 1
    assert [without_ts(line) for line in proxy_logging.getvalue().splitlines()] == [ANSWERED_LINE] * 2
