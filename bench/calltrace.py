"""What one request walks through in the proxy's code: a call trace per protocol.

    python -m bench.calltrace [--out FILE] [--exchange MODULE ...]

Each protocol's generation request (chat completions, Anthropic Messages, Responses), whole and
streamed, goes through ``create_app`` in process (ASGI messages, no server) to
the fake vLLM backend (``fake-backend``) in another process. After a warm-up request of the same shape, one
request is traced with ``sys.setprofile``: every call into the project's own packages
(``proxy``, ``summarizer``) is counted. Printed per request: calls, distinct functions, distinct
files, and how many separate times the exchange module(s) were entered from outside them (a
call from another module, not a call within them); ``--out`` writes the same as JSON, with the
files and their call counts, to compare a before and an after.

The request is a realistic agent turn: a multi-line system prompt, two tools, one earlier turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from bench.inprocess import access_log_to_devnull
from bench.servers import fake_backend
from proxy.app import create_app
from proxy.config import Settings
from testbed.serving import json_post_scope

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / name) + "/" for name in ("proxy", "summarizer"))
DEFAULT_EXCHANGE = ["proxy/routes/forward.py"]

MODEL = "fake-model"
SYSTEM = "\n".join(
    [
        "You are the support assistant of an online shop.",
        "Answer in the customer's language, briefly, and cite the order number you talk about.",
        "Never promise a refund before the order's status says it is eligible.",
        "",
        "Today is 2026-12-02 10:14:03.",
    ]
)
TOOLS = [
    {
        "name": "order_status",
        "description": "The status of an order by its number.",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]},
    },
    {
        "name": "refund",
        "description": "Start a refund for an eligible order.",
        "parameters": {
            "type": "object",
            "properties": {"order": {"type": "string"}, "reason": {"type": "string"}},
            "required": ["order"],
        },
    },
]


def chat_body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "stream": stream,
        "tools": [{"type": "function", "function": tool} for tool in TOOLS],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is order 1042?"},
            {"role": "assistant", "content": "It shipped yesterday."},
            {"role": "user", "content": "And when will it arrive?"},
        ],
    }


def messages_body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "stream": stream,
        "system": [{"type": "text", "text": SYSTEM}],
        "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS],
        "messages": [
            {"role": "user", "content": "Where is order 1042?"},
            {"role": "assistant", "content": [{"type": "text", "text": "It shipped yesterday."}]},
            {"role": "user", "content": [{"type": "text", "text": "And when will it arrive?"}]},
        ],
    }


def responses_body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_output_tokens": 16,
        "stream": stream,
        "store": False,
        "instructions": SYSTEM,
        "tools": [{"type": "function", **tool} for tool in TOOLS],
        "input": [
            {"role": "user", "content": "Where is order 1042?"},
            {"role": "assistant", "content": "It shipped yesterday."},
            {"role": "user", "content": "And when will it arrive?"},
        ],
    }


REQUESTS = {
    "chat": ("/v1/chat/completions", chat_body),
    "messages": ("/v1/messages", messages_body),
    "responses": ("/v1/responses", responses_body),
}


class Tracer:
    def __init__(self, exchange: list[str]) -> None:
        self.exchange = tuple(str(ROOT / name) for name in exchange)
        self.calls: Counter[tuple[str, str]] = Counter()
        self.entries = 0

    def __call__(self, frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGES):
            return
        self.calls[(filename, frame.f_code.co_qualname)] += 1
        if filename in self.exchange:
            caller = frame.f_back
            if caller is None or caller.f_code.co_filename not in self.exchange:
                self.entries += 1

    def summary(self) -> dict[str, Any]:
        files: Counter[str] = Counter()
        for (filename, _), count in self.calls.items():
            files[str(Path(filename).relative_to(ROOT))] += count
        return {
            "calls": sum(self.calls.values()),
            "functions": len(self.calls),
            "files": len(files),
            "exchange_entries": self.entries,
            "per_file": dict(files.most_common()),
        }


async def send(app: Any, path: str, body: bytes) -> int:
    received = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def reply(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(json_post_scope(path, body), receive, reply)
    return status


async def trace_all(app: Any, exchange: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        for name, (path, make) in REQUESTS.items():
            for stream in (False, True):
                body = json.dumps(make(stream)).encode()
                if await send(app, path, body) != 200:  # warm-up: imports, first-sight learning
                    raise RuntimeError(f"{name} answered an error")
                await asyncio.sleep(0.05)  # background work of the warm-up ends first
                tracer = Tracer(exchange)
                sys.setprofile(tracer)
                try:
                    await send(app, path, body)
                    await asyncio.sleep(0.05)  # and the traced request's own background work
                finally:
                    sys.setprofile(None)
                results[f"{name}{' stream' if stream else ''}"] = tracer.summary()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.calltrace", description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--exchange", nargs="+", default=DEFAULT_EXCHANGE, help="files of the exchange")
    args = parser.parse_args(argv)
    with fake_backend() as upstream:
        settings = Settings(upstream=upstream)
        app = create_app(settings)
        with access_log_to_devnull(settings.log_level):
            results = asyncio.run(trace_all(app, args.exchange))
    print(f"{'request':<18} {'calls':>6} {'functions':>9} {'files':>5} {'exchange entered':>16}")
    for name, result in results.items():
        print(
            f"{name:<18} {result['calls']:>6} {result['functions']:>9} {result['files']:>5}"
            f" {result['exchange_entries']:>16}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
