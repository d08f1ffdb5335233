"""A scripted upstream double for the stream review: each request's ``model`` names a script, a list
of byte pieces (sent as they are), floats (sleeps) and RESET (the connection is dropped mid-body)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.config import Settings
from tests.helpers import LiveServer, steady_window_s

RESET = object()

Script = list[Any]
SCRIPTS: dict[str, Callable[[dict[str, Any]], Script]] = {}
SEEN: list[dict[str, Any]] = []
EVENTS: list[str] = []  # what the upstream noticed ("closed:<model>", "sent:<model>:<bytes>")


def data(payload: Any, sep: bytes = b"data: ", end: bytes = b"\n\n") -> bytes:
    return sep + json.dumps(payload, separators=(",", ":")).encode() + end


def ev(kind: str, payload: Any) -> bytes:
    return f"event: {kind}\n".encode() + data(payload)


def chunk(
    content: str | None = None,
    *,
    finish: str | None = None,
    usage: Any = None,
    tool: Any = None,
    choices: Any = ...,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    if choices is ...:
        delta: dict[str, Any] = {}
        if content is not None:
            delta["content"] = content
        if tool is not None:
            delta["tool_calls"] = tool
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    body["choices"] = choices
    if usage is not None:
        body["usage"] = usage
    body.update(extra or {})
    return body


USAGE = {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}


def vllm_chat(text: list[str], usage: dict[str, Any] = USAGE) -> list[bytes]:
    """What vLLM sends: role chunk, content chunks, finish, the include_usage chunk, [DONE]."""
    out = [
        data(
            chunk(
                choices=[
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ]
            )
        )
    ]
    out += [data(chunk(t)) for t in text]
    out.append(data(chunk(finish="stop")))
    out.append(data(chunk(choices=[], usage=usage)))
    out.append(b"data: [DONE]\n\n")
    return out


async def _body(script: Script, model: str) -> Any:
    sent = 0
    try:
        for piece in script:
            if isinstance(piece, int | float):
                await asyncio.sleep(piece)
            elif piece is RESET:
                raise ConnectionResetError("scripted reset")
            else:
                sent += len(piece)
                EVENTS.append(f"sent:{model}:{sent}")
                yield piece
    except (asyncio.CancelledError, GeneratorExit):
        EVENTS.append(f"closed:{model}")
        raise


def upstream_app() -> Starlette:
    async def generate(request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        SEEN.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        model = str(body.get("model"))
        script = SCRIPTS[model](body)
        headers = {}
        if script and isinstance(script[0], dict):  # response headers
            headers = script.pop(0)
        return StreamingResponse(_body(script, model), media_type="text/event-stream", headers=headers)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": 8192} for m in SCRIPTS]}
        )

    async def tokenize(request: Request) -> Response:
        return JSONResponse({"count": 10, "max_model_len": 8192, "tokens": list(range(10))})

    paths = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            *(Route(p, generate, methods=["POST"]) for p in paths),
        ]
    )


_UPSTREAM: LiveServer | None = None


def upstream() -> LiveServer:
    global _UPSTREAM
    if _UPSTREAM is None:
        _UPSTREAM = LiveServer(upstream_app(), name="review-upstream").start()
    return _UPSTREAM


def proxy(**settings: Any) -> LiveServer:
    settings.setdefault("upstream", upstream().url + "/v1")
    return LiveServer(create_app(Settings(**settings))).start()


BUDGET = 100_000


def budget_proxy(**settings: Any) -> LiveServer:
    return proxy(budget={"session_tokens_per_window": BUDGET, "window_s": steady_window_s()}, **settings)


def session_state(server: LiveServer, response: httpx.Response, session: str) -> dict[str, Any]:
    sid = response.headers["x-prefix-proxy-session"]
    deadline = time.monotonic() + 5
    while True:
        state = httpx.get(f"{server.url}/v1/sessions/{sid}", headers={"x-session-id": session}).json()
        if state.get("requests") or time.monotonic() > deadline:
            return dict(state)
        time.sleep(0.05)


def new_session() -> str:
    return f"rev-{uuid.uuid4()}"


def sse_events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, payload = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                payload = line[5:].lstrip(" ")
        if payload is not None:
            out.append((name, payload))
    return out


def split_bytes(pieces: list[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        for i in range(len(piece)):
            yield piece[i : i + 1]


RUSAGE = {
    "input_tokens": 20,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 3,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 23,
}


def responses_stream(text, rid="resp_abc123"):
    base = {
        "id": rid,
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": "in_progress",
        "output": [],
        "usage": None,
    }
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    done_msg = {**msg, "status": "completed", "content": [{**part, "text": text}]}
    seq = [
        ("response.created", {"response": base}),
        ("response.in_progress", {"response": base}),
        ("response.output_item.added", {"output_index": 0, "item": msg}),
        ("response.content_part.added", {"output_index": 0, "item_id": "msg_1", "content_index": 0, "part": part}),
    ]
    words = text.split(" ")
    for i, w in enumerate(words):
        seq.append(
            (
                "response.output_text.delta",
                {
                    "output_index": 0,
                    "item_id": "msg_1",
                    "content_index": 0,
                    "delta": w if i == 0 else " " + w,
                    "logprobs": [],
                },
            )
        )
    seq += [
        (
            "response.output_text.done",
            {"output_index": 0, "item_id": "msg_1", "content_index": 0, "text": text, "logprobs": []},
        ),
        (
            "response.content_part.done",
            {"output_index": 0, "item_id": "msg_1", "content_index": 0, "part": {**part, "text": text}},
        ),
        ("response.output_item.done", {"output_index": 0, "item": done_msg}),
        ("response.completed", {"response": {**base, "status": "completed", "output": [done_msg], "usage": RUSAGE}}),
    ]
    return [ev(k, {"type": k, "sequence_number": n, **p}) for n, (k, p) in enumerate(seq)]


def msg_stream(blocks_events, usage_in=20, usage_out=3, err=None):
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "m",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": usage_in, "output_tokens": 0},
        },
    }
    out = [ev("message_start", start)]
    out += blocks_events
    if err is not None:
        out.append(err)
        return out
    out += [
        ev(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": usage_out},
            },
        ),
        ev("message_stop", {"type": "message_stop"}),
    ]
    return out


def text_block(parts, i=0):
    out = [
        ev(
            "content_block_start",
            {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
        )
    ]
    out += [
        ev(
            "content_block_delta",
            {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": p}},
        )
        for p in parts
    ]
    out.append(ev("content_block_stop", {"type": "content_block_stop", "index": i}))
    return out


def tool_block(inp, i=0):
    return [
        ev(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": i,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {}},
            },
        ),
        ev(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": i,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(inp)},
            },
        ),
        ev("content_block_stop", {"type": "content_block_stop", "index": i}),
    ]
