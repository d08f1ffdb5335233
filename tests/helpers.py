"""What many tests share: an ASGI app served on a free port in a thread, a chat completion request,
and the external executables a test needs.

    server = LiveServer(create_app(settings)).start()  # or: with LiveServer(app) as server:
    response = chat(server, messages, max_tokens=20)  # POST /v1/chat/completions, not raised
    response, text = stream_chat(server, messages)    # stream=True, the deltas' text joined
    body = chat_ok(server, messages)                  # asserts 200, returns the JSON body
    promtool = require_executable("promtool", PROMETHEUS_HINT)  # its path, or the test fails

``chat``'s target is a :class:`LiveServer`, a server's root URL ("http://127.0.0.1:PORT", the API under
/v1) or an ``httpx.Client`` whose base URL is that root. Keyword arguments other than the named ones
go into the request body; the body is ``{"model": "fake-model", "messages": messages}`` plus those.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from testbed.serving import LiveServer, free_port

__all__ = [
    "CHAT_PATH",
    "MODEL",
    "PROMETHEUS_HINT",
    "LiveServer",
    "achat_ok",
    "chat",
    "chat_ok",
    "free_port",
    "require_executable",
    "sse_text",
    "stream_chat",
]

MODEL = "fake-model"  # what the fake backend serves by default
CHAT_PATH = "/v1/chat/completions"

PROMETHEUS_HINT = (
    "these tests need Prometheus' own executables (Debian/Ubuntu: apt-get install prometheus; "
    "README's test command, bash scripts/test.sh, installs it)"
)

Messages = list[dict[str, Any]]


def require_executable(name: str, hint: str) -> str:
    """The path of the executable ``name``. Missing, the test fails (not skips: a run without it must
    not pass), saying what needs it and how to install it (``hint``)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: {hint}")
    return path


Target = LiveServer | str | httpx.Client


@contextmanager
def _client(target: Target, timeout: float) -> Iterator[httpx.Client]:
    if isinstance(target, httpx.Client):
        yield target
        return
    with httpx.Client(base_url=target.url if isinstance(target, LiveServer) else target, timeout=timeout) as client:
        yield client


def _request(
    messages: Messages, model: str, key: str | None, headers: Mapping[str, str] | None, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    sent = {"model": model, "messages": messages, **body}
    all_headers = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return sent, all_headers


def chat(
    target: Target,
    messages: Messages,
    *,
    model: str = MODEL,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    **body: Any,
) -> httpx.Response:
    """POST /v1/chat/completions; the response whatever its status (``stream=True`` is read whole).

    ``key``: sent as ``authorization: Bearer KEY``; ``headers``: more headers (they win over ``key``).
    """
    sent, all_headers = _request(messages, model, key, headers, body)
    with _client(target, timeout) as client:
        return client.post(CHAT_PATH, json=sent, headers=all_headers, timeout=timeout)


def chat_ok(target: Target, messages: Messages, **options: Any) -> dict[str, Any]:
    """:func:`chat` that must answer 200; its JSON body."""
    response = chat(target, messages, **options)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def stream_chat(
    target: Target,
    messages: Messages,
    *,
    model: str = MODEL,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    **body: Any,
) -> tuple[httpx.Response, str]:
    """A streamed chat completion (``stream=True`` is added), read line by line: the response (read
    and closed) and the text of its deltas (:func:`sse_text`; "" when it is not an event stream)."""
    sent, all_headers = _request(messages, model, key, headers, {**body, "stream": True})
    with (
        _client(target, timeout) as client,
        client.stream("POST", CHAT_PATH, json=sent, headers=all_headers, timeout=timeout) as response,
    ):
        text = sse_text(response.iter_lines())
    return response, text


def sse_text(lines: Iterable[str]) -> str:
    """The assistant's text in a chat completion event stream: every choice's delta content, in order."""
    parts = []
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: ")).get("choices") or []:
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


async def achat_ok(client: httpx.AsyncClient, messages: Messages, *, model: str = MODEL, **body: Any) -> dict[str, Any]:
    """:func:`chat_ok` on an ``httpx.AsyncClient`` (e.g. one on an ASGI transport): the JSON body of a 200."""
    response = await client.post(CHAT_PATH, json={"model": model, "messages": messages, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def steady_window_s(at_least_s: int = 600, lasting_s: float = 300.0) -> int:
    """A budget window (``budget.window_s``, at least ``at_least_s``) whose current window lasts
    ``lasting_s`` more. Windows are aligned to the epoch (proxy.sessions.store.window_of): a test
    that crosses a boundary sees its usage start over, and a limit it means to reach is never reached."""
    now = time.time()
    window = at_least_s
    while window - now % window < lasting_s:
        window += 1
    return window


def wait_healthy(url: str, timeout_s: float = 30.0) -> bool:
    """Whether ``url``/healthz answered 200 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.1)
    return False


class ProxyProcess:
    """``prefix-proxy serve`` in a process of its own (settings from ``env``), ready on return."""

    def __init__(self, upstream: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(self.port)],
            env={**os.environ, "PREFIX_PROXY_LOG_LEVEL": "warning", **env},
        )
        if not wait_healthy(self.url):
            self.stop()
            raise RuntimeError("proxy process did not start")

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)
