"""A backend that answers at once: what is measured behind it is the hop in front of it.

A bare ASGI app (no framework) under uvicorn: it reads the request body and answers a fixed
OpenAI-shaped chat completion (or three SSE chunks and ``[DONE]`` for ``stream: true``), with
``usage`` so proxies that account tokens have something to read; on ``/v1/messages`` an Anthropic
message (or its SSE events). ``GET /v1/models`` and ``GET /health`` answer too (readiness checks of
the proxies under test).

    python -m bench.instant_backend --port 8000 [--max-model-len 131072] [--prompt-tokens 8000]

``--max-model-len``: the model's context ``GET /v1/models`` gives (what the proxy's budgets derive
from); ``--prompt-tokens``: the prompt tokens every answer's ``usage`` reports.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MODEL = "fake-model"
MAX_MODEL_LEN = 131072
PROMPT_TOKENS = 8000


@dataclass(frozen=True)
class Answers:
    """The fixed bodies one backend answers with: its model's context (``GET /v1/models``) and the
    prompt tokens its ``usage`` reports."""

    completion: bytes
    stream: bytes
    anthropic: bytes
    anthropic_stream: bytes
    models: bytes


def answers(max_model_len: int = MAX_MODEL_LEN, prompt_tokens: int = PROMPT_TOKENS) -> Answers:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
        "prompt_tokens_details": None,
    }
    completion = json.dumps(
        {
            "id": "chatcmpl-instant",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "OK, done."}, "finish_reason": "stop"}
            ],
            "usage": usage,
        }
    ).encode()
    chunk = {"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    stream = (
        b"".join(
            b"data: " + json.dumps(event).encode() + b"\n\n"
            for event in (
                {
                    **chunk,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "OK"}, "finish_reason": None}],
                },
                {**chunk, "choices": [{"index": 0, "delta": {"content": ", done."}, "finish_reason": "stop"}]},
                {**chunk, "choices": [], "usage": usage},
            )
        )
        + b"data: [DONE]\n\n"
    )
    message = {
        "id": "msg_instant",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "OK, done."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 4},
    }
    anthropic_stream = b"".join(
        f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
        for event in (
            {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
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
    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": max_model_len}]}
    return Answers(completion, stream, json.dumps(message).encode(), anthropic_stream, json.dumps(models).encode())


def make_app(found: Answers) -> Callable[[dict[str, Any], Receive, Send], Awaitable[None]]:
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
            payload, kind = (found.stream, b"text/event-stream") if stream else (found.completion, b"application/json")
        elif path.endswith("/messages"):
            stream = b'"stream":true' in body.replace(b" ", b"")
            payload, kind = (
                (found.anthropic_stream, b"text/event-stream") if stream else (found.anthropic, b"application/json")
            )
        elif path.endswith("/models"):
            payload, kind = found.models, b"application/json"
        else:
            payload, kind = b'{"status":"ok"}', b"application/json"
        headers = [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


app = make_app(answers())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-model-len", type=int, default=MAX_MODEL_LEN, help="the model's context, as GET /v1/models gives it"
    )
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="prompt tokens every usage reports")
    args = parser.parse_args()
    served = make_app(answers(args.max_model_len, args.prompt_tokens))
    uvicorn.run(served, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
