"""A backend that answers at once: what is measured behind it is the hop in front of it.

A bare ASGI app (no framework) under uvicorn: it reads the request body and answers a fixed
OpenAI-shaped chat completion (or three SSE chunks and ``[DONE]`` for ``stream: true``), with
``usage`` so proxies that account tokens have something to read; on ``/v1/messages`` an Anthropic
message (or its SSE events). ``GET /v1/models`` and ``GET /health`` answer too (readiness checks of
the proxies under test).

    python -m bench.instant_backend --port 8000
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MODEL = "fake-model"
_USAGE = {"prompt_tokens": 8000, "completion_tokens": 4, "total_tokens": 8004, "prompt_tokens_details": None}
_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK, done."}, "finish_reason": "stop"}],
        "usage": _USAGE,
    }
).encode()
_CHUNK = {"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
_STREAM = (
    b"".join(
        b"data: " + json.dumps(event).encode() + b"\n\n"
        for event in (
            {
                **_CHUNK,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "OK"}, "finish_reason": None}],
            },
            {**_CHUNK, "choices": [{"index": 0, "delta": {"content": ", done."}, "finish_reason": "stop"}]},
            {**_CHUNK, "choices": [], "usage": _USAGE},
        )
    )
    + b"data: [DONE]\n\n"
)
_MESSAGE = {
    "id": "msg_instant",
    "type": "message",
    "role": "assistant",
    "model": MODEL,
    "content": [{"type": "text", "text": "OK, done."}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 8000, "output_tokens": 4},
}
_ANTHROPIC = json.dumps(_MESSAGE).encode()
_ANTHROPIC_STREAM = b"".join(
    f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
    for event in (
        {"type": "message_start", "message": {**_MESSAGE, "content": [], "stop_reason": None}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "OK, done."}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 4},
        },
        {"type": "message_stop"},
    )
)
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 131072}]}).encode()


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    path = scope["path"]
    if path.endswith("/chat/completions"):
        stream = b'"stream":true' in body.replace(b" ", b"")
        payload, kind = (_STREAM, b"text/event-stream") if stream else (_COMPLETION, b"application/json")
    elif path.endswith("/messages"):
        stream = b'"stream":true' in body.replace(b" ", b"")
        payload, kind = (_ANTHROPIC_STREAM, b"text/event-stream") if stream else (_ANTHROPIC, b"application/json")
    elif path.endswith("/models"):
        payload, kind = _MODELS, b"application/json"
    else:
        payload, kind = b'{"status":"ok"}', b"application/json"
    headers = [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
