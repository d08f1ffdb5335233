"""The CPU the proxy's own code spends per request: its ASGI app driven in process, no server.

    python -m bench.inprocess [--requests 300] [--rounds 7] [--tokens 8000] [--messages 0]
                              [--shape NAME] [--settings JSON] [--bare] [--cprofile TOP]

Each request is an 8k-token chat (``--messages N``: a system prompt and N earlier turns instead)
of a new conversation, or (``--shape NAME``) the next request of one of ``bench.shapes``'s
shapes (a Dify app, a 20-turn agent, Claude Code on ``/v1/messages``, Open WebUI, a new system
prompt each time), sent to ``create_app`` with ASGI messages and answered by
``bench.instant_backend`` in another process; the access log goes to ``/dev/null`` and the heap is
frozen after warm-up, as ``prefix-proxy serve`` has them. Printed: the process CPU time per request
of each round (min and median first). ``--bare`` drives ``bench.bare_hop``'s app instead (the
upstream client and a Starlette route, no logic; ``--bare --json``: the body parsed and written
again too); ``--settings`` overrides the defaults, to see
what one part costs by turning it off, e.g. ``--settings '{"cache_breaks": {"enabled": false}}'``.
``--cprofile TOP`` prints cProfile's TOP functions by own time over one more round.
``--bodies-only`` makes the same request bodies round by round and sends none: what the driver
itself spends per request, which ``bench.instructions`` takes off its counts. ``--patch FILE`` runs
a Python file (a prototype patching the proxy's functions) before the app is built.

``--history TURNS`` drives one conversation of ``bench.history`` instead (``--style dify`` or
``agent``, ``--session`` with an ``x-session-id`` header, ``--summary`` with a summary in place):
resumed at TURNS earlier turns, each request a turn longer.

Without uvicorn in front, the difference between two runs is the difference in the app's code.
The machine drifts: compare runs made one after the other, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import logging
import os
import pstats
import runpy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench import shapes
from bench.bare_hop import create_app as create_bare_app
from bench.instant_backend import MODEL
from bench.overhead import prompt_of
from bench.servers import free_port, spawn
from proxy.app import create_app
from proxy.config import Settings
from proxy.observability import configure_logging
from testbed.serving import json_post_scope

Message = dict[str, Any]


def body_of(salt: int, tokens: int, messages: int) -> bytes:
    if not messages:
        history = [{"role": "user", "content": prompt_of(tokens, salt)}]
    else:
        history = [{"role": "system", "content": "You are a helpful assistant. " * 40}]
        for turn in range(messages):
            role = "user" if turn % 2 == 0 else "assistant"
            history.append({"role": role, "content": f"Conversation {salt}, turn {turn}. " + prompt_of(150, turn)})
        history.append({"role": "user", "content": f"Conversation {salt}: and now?"})
    return json.dumps({"model": MODEL, "max_tokens": 16, "messages": history}).encode()


async def send_one(
    app: Any, body: bytes, path: str = "/v1/chat/completions", headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    scope = json_post_scope(path, body)
    if headers:
        scope["headers"] = [*scope["headers"], *headers]
    received = False
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if sent[0].get("status") != 200:
        raise RuntimeError(f"the app answered {sent}")


def body_maker(args: argparse.Namespace) -> tuple[Callable[[int], list[bytes]], str]:
    """What makes the next ``count`` request bodies (the driver's sequence), and their path."""
    salts = iter(range(10**9))
    if args.history:
        # One conversation of ``bench.history``, resumed at ``--history`` turns (the warm-up's
        # first request), each next request a turn longer.
        from bench.history import Conversation, messages_body

        conversation = Conversation(args.style, 1, args.tokens)
        turns = iter(range(max(1, args.history - 1), 10**9))
        if args.protocol == "messages":
            return (
                lambda count: [json.dumps(messages_body(conversation.body(next(turns)))).encode() for _ in range(count)]
            ), "/v1/messages"
        return (lambda count: [json.dumps(conversation.body(next(turns))).encode() for _ in range(count)]), (
            "/v1/chat/completions"
        )
    shape = shapes.build(args.shape, args.tokens) if args.shape else None
    path = "/v1" + shape.path if shape is not None else "/v1/chat/completions"

    def bodies(count: int) -> list[bytes]:
        if shape is not None:
            return [json.dumps(shape.body(next(salts))).encode() for _ in range(count)]
        return [body_of(next(salts), args.tokens, args.messages) for _ in range(count)]

    return bodies, path


def make_bodies_only(args: argparse.Namespace) -> None:
    """The bodies :func:`measure` makes, in the same rounds, sent nowhere."""
    bodies, _ = body_maker(args)
    bodies(warm_up(args))
    for _ in range(args.rounds):
        bodies(args.requests)


# Requests sent before the rounds (not timed).
WARM_UP = 100


async def measure(app: Any, args: argparse.Namespace) -> list[float]:
    bodies, path = body_maker(args)
    headers = [(b"x-session-id", b"bench-inprocess")] if args.session else None

    async with app.router.lifespan_context(app):
        for body in bodies(warm_up(args)):
            await send_one(app, body, path, headers)
        gc.collect()
        gc.freeze()
        rounds = []
        for _ in range(args.rounds):
            batch = bodies(args.requests)  # made before the clock starts: only the app is timed
            started_at = time.process_time()
            for body in batch:
                await send_one(app, body, path, headers)
            rounds.append((time.process_time() - started_at) / args.requests * 1e6)
        if args.cprofile:
            batch = bodies(args.requests)
            profiler = cProfile.Profile()
            profiler.enable()
            for body in batch:
                await send_one(app, body, path, headers)
            profiler.disable()
            pstats.Stats(profiler).sort_stats(args.cprofile_sort).print_stats(args.cprofile)
    gc.unfreeze()
    return rounds


def warm_up(args: argparse.Namespace) -> int:
    """Requests sent before the rounds: a conversation resumed (``--history``) is warm after two."""
    return 2 if args.history else WARM_UP


@contextlib.contextmanager
def access_log_to_devnull(level: str) -> Iterator[None]:
    """The access log as ``prefix-proxy serve`` writes it, to /dev/null; the loggers as they were
    afterwards (a caller in the same process keeps its own)."""
    logger = logging.getLogger("prefix_proxy")
    handlers, logger_level, propagate = logger.handlers[:], logger.level, logger.propagate
    with open(os.devnull, "w") as devnull:
        configure_logging(level, devnull)
        try:
            yield
        finally:
            logger.handlers[:] = handlers
            logger.setLevel(logger_level)
            logger.propagate = propagate


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--messages", type=int, default=0, help="earlier turns in each request")
    parser.add_argument("--shape", choices=shapes.SHAPE_NAMES, help="requests of this shape (bench.shapes) instead")
    parser.add_argument("--settings", default="{}", help="settings overrides (JSON)")
    parser.add_argument("--bare", action="store_true", help="bench.bare_hop's app: no logic")
    parser.add_argument("--json", action="store_true", help="with --bare: parse and write the body again")
    parser.add_argument("--cprofile", type=int, default=0, metavar="TOP")
    parser.add_argument("--cprofile-sort", default="tottime", help="cProfile's order: tottime (own time) or cumulative")
    parser.add_argument("--bodies-only", action="store_true", help="make the bodies, send none")
    parser.add_argument("--patch", help="a Python file run before the app is built (a prototype)")
    parser.add_argument(
        "--history", type=int, default=0, metavar="TURNS", help="one conversation of bench.history resumed at TURNS"
    )
    parser.add_argument("--style", choices=("dify", "agent"), default="dify", help="with --history: its style")
    parser.add_argument(
        "--protocol",
        choices=("chat", "messages"),
        default="chat",
        help="with --history --style dify: the conversation on /v1/chat/completions or Anthropic's /v1/messages",
    )
    parser.add_argument("--session", action="store_true", help="send an x-session-id header")
    parser.add_argument(
        "--summary", action="store_true", help="with --history: a summary in place (bench.history's summary rows)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    arguments = parser()
    args = arguments.parse_args(argv)
    if args.protocol == "messages" and (not args.history or args.style != "dify"):
        arguments.error("--protocol messages is a Dify-style conversation: give it with --history N --style dify")
    if args.json and not args.bare:
        arguments.error("--json parses the body in the bare stack: give it with --bare")
    if args.bodies_only:
        make_bodies_only(args)
        return
    if args.patch:
        runpy.run_path(args.patch)
    port = free_port()
    backend = [sys.executable, "-m", "bench.instant_backend", "--port", str(port)]
    overrides = json.loads(args.settings)
    if args.history:
        from bench.history import LONG_CONTEXT, SUMMARY_CONTEXT, SUMMARY_USAGE

        context, usage = (SUMMARY_CONTEXT, SUMMARY_USAGE) if args.summary else (LONG_CONTEXT, 8000)
        backend += ["--max-model-len", str(context), "--prompt-tokens", str(usage)]
        if args.summary:
            overrides = {**overrides, "summarizer": {**overrides.get("summarizer", {}), "apply_ratio": 0}}
    with spawn(backend, f"http://127.0.0.1:{port}/health"), contextlib.ExitStack() as stack:
        upstream = f"http://127.0.0.1:{port}/v1"
        if args.bare:
            app: Any = create_bare_app(upstream, json=args.json)
        else:
            settings = Settings(upstream=upstream, **overrides)
            app = create_app(settings)
            stack.enter_context(access_log_to_devnull(settings.log_level))
        rounds = asyncio.run(measure(app, args))
    ordered = sorted(rounds)
    print(
        f"CPU per request in process: min {ordered[0]:.0f} us, median {statistics.median(rounds):.0f} us "
        f"(rounds: {', '.join(f'{r:.0f}' for r in rounds)})"
    )


if __name__ == "__main__":
    main()
