"""The proxy's CPU per request as one conversation grows: flat in its length, or not.

    python -m bench.history [--turns 10,50,200,1000] [--window 10] [--rounds 3]
                            [--styles dify,agent] [--cases plain,session,summary,summary-session]
                            [--tokens 8000] [--before CHECKOUT] [--profile DIR] [--grown]

A client re-sends a conversation's whole history on every turn: request ``t`` is request ``t-1``
plus the reply and a new user message. Per row (a style and a case) and per history length ``N``,
a new conversation is resumed at ``N - 1`` earlier turns (one request carrying that history whole,
as a client resuming a long chat sends it; not timed; with ``--grown``, every earlier turn is sent
first, one request each, as a conversation held through the proxy from its start, so that what
the proxy keeps per turn is there), then ``--window`` requests carrying
``N``, ``N + 1``, ... earlier turns are sent one after the other, and the CPU the proxy process
spent on them (each thread's schedstat nanoseconds, ``bench.overhead.CpuReading``) is divided by
their number. Rows, lengths and proxies take turns in an order that rotates (``bench.overhead.
rotated``), over ``--rounds`` rounds, each with new conversations.

Styles, from the real data (``bench.shapes``): ``dify``: a Dify app's system prompt of about
``--tokens`` (the one of ``bench.hop``'s dify row, its clock line ticking every request) and
ShareGPT's turns (``sharegpt_dummy.json``: a human's message and the model's reply, in an order each
conversation shuffles its own, so that no two share a run of turns; MT-bench questions answered by
a fixed line where the data set is absent); ``agent``: a
function-calling agent (``bench.hop``'s agent20: its system prompt and 21 BFCL tools) whose every
turn is an MT-bench question, a tool call, the tool's result and the answer.

Cases: ``plain`` (no session header: the proxy infers the conversation), ``session`` (an
``x-session-id`` header), and the same two with a summary in place (``summary``,
``summary-session``): there the backend's model has a 4,096-token context and its usage reports
1,000 prompt tokens, the proxy makes a summary once a conversation passes a tenth of it
(``budget.soft_ratio: 0.1``, ``summarizer.lookahead_requests: 0``) and applies a ready one at once
(``summarizer.apply_ratio: 0``); the resuming request is re-sent, untimed, until its summary (of
all but its last 4 turns) is in place, so that
each request of the window applies the summary to a history it mostly stands for. Elsewhere the
backend's model has a 1M-token context (a 1,000-turn agent conversation is about 300k tokens), so
no summary is made. Every proxy is prefix-proxy on its defaults otherwise, as a subprocess behind
``bench.instant_backend`` (a backend that answers at once: what is measured is the proxy).

Printed: per row and length, the CPU per request in ms and its ratio to the shortest length, and
how many of the window's requests had the summary applied (the ``x-prefix-proxy-actions``
header), which must be all of them on a summary row and none elsewhere. ``--before CHECKOUT``
runs that checkout of prefix-proxy beside this one (before/after); ``--profile DIR`` then records
each prefix-proxy with py-spy over one more window of each row at the longest length
(``DIR/<proxy>-<row>.txt`` and ``.svg``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import shapes, stacks
from bench.overhead import (
    BARE_HOP,
    Hop,
    bare_hop,
    checkouts,
    cpu_reading,
    find,
    prefix_proxy,
    profiled,
    rotated,
    vllm_router,
)
from bench.servers import free_port, spawn

MODEL = shapes.MODEL
STYLES = ("dify", "agent", "messages")
CASES = ("plain", "session", "summary", "summary-session")
# The row of a style measured through the floor of a hop (``bench.bare_hop``: the proxy's server and
# upstream client carrying the body, no logic) instead.
FLOOR = "floor"
TURNS = (10, 50, 200, 1000)
# Where a summary is in place: a model this small, a usage this low (see the module's docstring).
SUMMARY_CONTEXT = 4096
SUMMARY_USAGE = 1000
# Elsewhere: a model whose context holds 1,000 agent turns, so nothing is compacted.
LONG_CONTEXT = 1 << 20
# A summary made once a conversation passes a tenth of that context, whatever its growth, and applied
# as soon as it is ready: what its usage calibrates the proxy's counts to cannot leave a short
# conversation under the point where one is made.
SUMMARY_SETTINGS = {
    "PREFIX_PROXY_SUMMARIZER__APPLY_RATIO": "0",
    "PREFIX_PROXY_BUDGET__SOFT_RATIO": "0.1",
    "PREFIX_PROXY_SUMMARIZER__LOOKAHEAD_REQUESTS": "0",
}
# How long the untimed resuming request is re-sent, on a summary row, until the summary is in place.
SUMMARY_WAIT_S = 60.0


# -- the conversations -------------------------------------------------------------------------


@cache
def sharegpt_turns() -> tuple[tuple[str, str], ...]:
    """ShareGPT's (human, reply) pairs in order; MT-bench questions with a fixed reply without it."""
    root = shapes.data_dir()
    path = root / "sharegpt_dummy.json" if root is not None else None
    if path is None or not path.is_file():
        return tuple((q, "Here is what I found about it.") for qs in shapes.corpus().questions for q in qs)
    pairs = []
    for conversation in json.loads(path.read_text(encoding="utf-8")):
        turns = conversation["conversations"]
        for asked, answered in zip(turns[::2], turns[1::2], strict=False):
            if asked["from"] == "human" and answered["from"] == "gpt":
                pairs.append((asked["value"], answered["value"]))
    return tuple(pairs)


@cache
def questions() -> tuple[str, ...]:
    return tuple(turn for q in shapes.corpus().questions for turn in q)


def source() -> str:
    root = shapes.data_dir()
    turns = "ShareGPT's turns" if root is not None and (root / "sharegpt_dummy.json").is_file() else "MT-bench"
    return f"{shapes.corpus().source}; dify turns: {turns}; agent questions: MT-bench"


@dataclass(frozen=True)
class Row:
    style: str
    case: str

    @property
    def name(self) -> str:
        return f"{self.style} {self.case}"

    @property
    def session(self) -> bool:
        return self.case.endswith("session")

    @property
    def summary(self) -> bool:
        return self.case.startswith("summary")


# Styles of text turns (ShareGPT's) under a Dify app's system prompt: on chat, and on Anthropic's Messages.
TEXT_STYLES = ("dify", "messages")


def messages_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat body of text turns as Anthropic's ``/v1/messages`` takes it: its system messages as
    ``system``, the turns as messages."""
    messages = chat["messages"]
    system = "\n".join(str(m["content"]) for m in messages if m["role"] == "system")
    turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    return {
        "model": chat.get("model", MODEL),
        "max_tokens": chat.get("max_tokens", 16),
        "system": system,
        "messages": turns,
    }


class Conversation:
    """One conversation of a style; :meth:`body` is its request after ``turns`` earlier turns."""

    def __init__(self, style: str, number: int, tokens: int) -> None:
        self.style, self.number = style, number
        self._dify = shapes.dify(tokens) if style in TEXT_STYLES else None
        self._system = shapes.agent_system() if style == "agent" else ""
        self._tools = shapes.agent_tools() if style == "agent" else []
        self._turns: list[list[dict[str, Any]]] = []
        # ShareGPT's turns in an order of the conversation's own: two conversations never re-send the
        # same run of turns (the proxy would take one for the other with its window slid).
        self._order = list(range(len(sharegpt_turns()))) if style in TEXT_STYLES else []
        random.Random(number).shuffle(self._order)

    def _pair(self, turn: int) -> tuple[str, str]:
        return sharegpt_turns()[self._order[turn % len(self._order)]]

    def _question(self, turn: int) -> str:
        opening = f"(chat {self.number}) " if turn == 0 else ""
        if self.style in TEXT_STYLES:
            return opening + self._pair(turn)[0]
        asked = questions()
        return opening + asked[(self.number * 3 + turn) % len(asked)]

    def _turn(self, turn: int) -> list[dict[str, Any]]:
        while len(self._turns) <= turn:
            t = len(self._turns)
            if self.style in TEXT_STYLES:
                asked, reply = self._question(t), self._pair(t)[1]
                self._turns.append([{"role": "user", "content": asked}, {"role": "assistant", "content": reply}])
            else:
                self._turns.append(shapes.agent_turn(self.number, t, self._question(t)))
        return self._turns[turn]

    def body(self, turns: int) -> dict[str, Any]:
        history = [message for t in range(turns) for message in self._turn(t)]
        asked = {"role": "user", "content": self._question(turns)}
        if self._dify is not None:
            # The app's system prompt as bench.hop's dify row sends it, its clock a tick further each request.
            system = self._dify.body(self.number * 10_000 + turns)["messages"][0]
            chat = {"model": MODEL, "max_tokens": 16, "messages": [system, *history, asked]}
            return messages_body(chat) if self.style == "messages" else chat
        messages = [{"role": "system", "content": self._system}, *history, asked]
        return {"model": MODEL, "max_tokens": 16, "tools": self._tools, "tool_choice": "auto", "messages": messages}


# -- the measurement ---------------------------------------------------------------------------


@dataclass
class Cell:
    """One proxy's figures for one row at one length, summed over the rounds."""

    seconds: float = 0.0
    requests: int = 0
    summarized: int = 0  # requests whose actions include the summary anchored

    @property
    def ms_per_request(self) -> float:
        return self.seconds / self.requests * 1e3 if self.requests else 0.0


@dataclass
class Proxies:
    """Per build (``checkouts``), the proxy without and the one with a summary in place; and the
    floors of a hop (the proxy's server and upstream client carrying the body, no logic; vLLM
    Router, a hop in Rust, where given)."""

    plain: list[Hop]
    summary: list[Hop]
    floors: list[Hop]

    def of(self, row: Row) -> list[Hop]:
        if row.case == FLOOR:
            # vLLM Router has no /v1/messages: the Messages style's floor is the bare hop's alone.
            return [h for h in self.floors if row.style != "messages" or h.name == BARE_HOP]
        return self.summary if row.summary else self.plain


@dataclass
class Results:
    turns: tuple[int, ...]
    window: int
    rows: list[Row]
    names: list[str]
    cells: dict[tuple[str, str, int], Cell] = field(default_factory=dict)
    floor_names: list[str] = field(default_factory=lambda: [BARE_HOP])

    def cell(self, proxy: str, row: Row, turns: int) -> Cell:
        return self.cells.setdefault((proxy, row.name, turns), Cell())

    def ms(self, proxy: str, row: Row, turns: int) -> float:
        return self.cell(proxy, row, turns).ms_per_request

    def floor_ms(self, row: Row, turns: int) -> float:
        """The floor's CPU per request on the row's style at ``turns`` (what reading and writing
        the body costs any proxy that rewrites it in Python)."""
        return self.ms(BARE_HOP, Row(row.style, FLOOR), turns)

    def over_floor(self, proxy: str, row: Row, turns: int) -> float:
        return self.ms(proxy, row, turns) - self.floor_ms(row, turns)


class Sender:
    """Posts a conversation's requests; tells whether each had the summary applied."""

    def __init__(self, client: httpx.AsyncClient, row: Row, conversation: Conversation) -> None:
        self._client, self._row = client, row
        self._conversation = conversation
        self._headers = {"content-type": "application/json"}
        if row.session:
            self._headers["x-session-id"] = f"bench-history-{conversation.number}"

    @property
    def row(self) -> Row:
        return self._row

    def made(self, turns: int) -> bytes:
        return orjson.dumps(self._conversation.body(turns))

    async def send(self, hop: Hop, content: bytes) -> bool:
        path = "/messages" if self._row.style == "messages" else "/chat/completions"
        response = await self._client.post(hop.base_url + path, content=content, headers=self._headers)
        response.raise_for_status()
        return "summary_anchored" in response.headers.get("x-prefix-proxy-actions", "")


async def window(sender: Sender, hop: Hop, turns: int, size: int, cell: Cell | None, grown: bool = False) -> None:
    """The conversation resumed at ``turns - 1`` earlier turns (on a summary row, re-sent until its
    summary is in place), then ``size`` requests from ``turns`` on, their CPU added to ``cell``.
    ``grown``: every earlier turn sent first, one request each (untimed), as a conversation held
    through the proxy from its start: what the proxy keeps per turn is there, as in production."""
    if grown:
        for earlier in range(1, turns - 1):
            await sender.send(hop, sender.made(earlier))
    resumed = sender.made(turns - 1)
    deadline = asyncio.get_running_loop().time() + SUMMARY_WAIT_S
    while not await sender.send(hop, resumed) and sender.row.summary and cell is not None:
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"{sender.row.name}: no summary in place after {SUMMARY_WAIT_S:.0f} s")
        await asyncio.sleep(0.05)
    bodies = [sender.made(t) for t in range(turns, turns + size)]  # made before the clock starts
    before = cpu_reading(hop.pid)
    summarized = [await sender.send(hop, body) for body in bodies]
    if cell is not None:
        cell.seconds += cpu_reading(hop.pid) - before
        cell.requests += size
        cell.summarized += sum(summarized)


@contextlib.contextmanager
def started(before: str | None, router: str | None = None) -> Iterator[Proxies]:
    """Two instant backends (a long context; a short one for the summary rows), per build a
    prefix-proxy in front of each, and the floors of a hop in front of the first (vLLM Router too,
    ``router`` being its executable)."""
    long_port, short_port = free_port(), free_port()
    backend = [sys.executable, "-m", "bench.instant_backend"]
    with contextlib.ExitStack() as stack:
        for port, context, usage in ((long_port, LONG_CONTEXT, 8000), (short_port, SUMMARY_CONTEXT, SUMMARY_USAGE)):
            args = [*backend, "--port", str(port), "--max-model-len", str(context), "--prompt-tokens", str(usage)]
            stack.enter_context(spawn(args, f"http://127.0.0.1:{port}/health"))
        plain, summary = [], []
        for name, checkout in checkouts(before):
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            plain.append(stack.enter_context(prefix_proxy(f"http://127.0.0.1:{long_port}/v1", checkout, name)))
            upstream = f"http://127.0.0.1:{short_port}/v1"
            summary.append(stack.enter_context(prefix_proxy(upstream, checkout, name, SUMMARY_SETTINGS)))
        floors = [stack.enter_context(bare_hop(f"http://127.0.0.1:{long_port}/v1"))]
        if router is not None:
            floors.append(stack.enter_context(vllm_router(router, f"http://127.0.0.1:{long_port}")))
        yield Proxies(plain, summary, floors)


async def measure(
    proxies: Proxies, rows: list[Row], turns: tuple[int, ...], size: int, rounds: int, tokens: int, grown: bool = False
) -> Results:
    floor_names = [hop.name for hop in proxies.floors]
    results = Results(turns, size, rows, [hop.name for hop in proxies.plain], floor_names=floor_names)
    rows = [*rows, *(Row(style, FLOOR) for style in dict.fromkeys(row.style for row in rows))]
    number = 0
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        # Warm every proxy's code paths on a short conversation of each row, not counted.
        for row in rows:
            for hop in proxies.of(row):
                number += 1
                await window(Sender(client, row, Conversation(row.style, number, tokens)), hop, 3, 3, None)
        step = 0
        for _ in range(rounds):
            for n in rotated(list(turns), step):
                for row in rotated(rows, step):
                    hops = proxies.of(row)
                    for k in rotated(list(range(len(hops))), step):
                        number += 1
                        sender = Sender(client, row, Conversation(row.style, number, tokens))
                        print(f"  {hops[k].name}: {row.name}, {n} turns", file=sys.stderr, flush=True)
                        await window(sender, hops[k], n, size, results.cell(hops[k].name, row, n), grown)
                    step += 1
    return results


async def profile(proxies: Proxies, rows: list[Row], turns: int, size: int, tokens: int, out: Path) -> list[str]:
    """py-spy over one more window of each row at ``turns``, per prefix-proxy."""
    py_spy = find(None, "py-spy")
    if py_spy is None:
        raise SystemExit("--profile: py-spy not found (pip install py-spy)")
    notes = []
    async with httpx.AsyncClient(timeout=300) as client:
        for row in rows:
            for index, hop in enumerate(proxies.of(row)):
                sender = Sender(client, row, Conversation(row.style, 900_000 + index, tokens))
                path = out / f"{hop.name.replace(' ', '-')}-{row.name.replace(' ', '-')}.txt"
                await sender.send(hop, sender.made(turns - 1))
                bodies = [sender.made(t) for t in range(turns, turns + size)]
                with profiled(hop.pid, path, py_spy):
                    for body in bodies:
                        await sender.send(hop, body)
                recorded = stacks.read(path)
                path.with_suffix(".svg").write_text(stacks.svg(recorded, f"{hop.name}, {row.name}, {turns} turns"))
                notes.append(f"{hop.name}, {row.name}, {turns} turns, py-spy ({path}):\n{stacks.markdown(recorded)}")
    return notes


def table(results: Results) -> str:
    """Per row: each proxy's CPU per request at each length (ms, and x the shortest length), and the
    requests whose summary was applied; per style, the floor's."""
    lengths = results.turns
    header = ["row", *(f"{name} {n} turns (ms, x {lengths[0]})" for name in results.names for n in lengths)]
    header.append("summary applied")
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for row in results.rows:
        cells = [row.name]
        for name in results.names:
            base = results.ms(name, row, lengths[0])
            cells += [f"{results.ms(name, row, n):.2f} ({_ratio(results.ms(name, row, n), base)})" for n in lengths]
        cells.append(f"{_applied(results, row)}")
        lines.append(f"| {' | '.join(cells)} |")
    for style in dict.fromkeys(row.style for row in results.rows):
        floor = Row(style, FLOOR)
        for hop in results.floor_names:
            if style == "messages" and hop != BARE_HOP:
                continue
            base = results.ms(hop, floor, lengths[0])
            cells = [
                f"{style}: {hop}",
                *(f"{results.ms(hop, floor, n):.2f} ({_ratio(results.ms(hop, floor, n), base)})" for n in lengths),
            ]
            cells += [""] * (len(header) - len(cells))
            lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def over_floor_table(results: Results) -> str:
    """Per row: each proxy's CPU per request over the floor's on the same style and length
    (what its own logic costs), and its ratio to the shortest length's."""
    lengths = results.turns
    header = ["row", *(f"{name} {n} turns (ms, x {lengths[0]})" for name in results.names for n in lengths)]
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    for row in results.rows:
        cells = [row.name]
        for name in results.names:
            base = results.over_floor(name, row, lengths[0])
            cells += [
                f"{results.over_floor(name, row, n):.2f} ({_ratio(results.over_floor(name, row, n), base)})"
                for n in lengths
            ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def _applied(results: Results, row: Row) -> str:
    cells = [results.cell(name, row, n) for name in results.names for n in results.turns]
    return f"{sum(c.summarized for c in cells)}/{sum(c.requests for c in cells)}"


def rows_of(styles: str, cases: str) -> list[Row]:
    chosen = [Row(style, case) for style in _names(styles, STYLES) for case in _names(cases, CASES)]
    return chosen


def _names(given: str, known: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in given.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


async def run(args: argparse.Namespace) -> str:
    rows = rows_of(args.styles, args.cases)
    turns = tuple(sorted(int(n) for n in args.turns.split(",")))
    router = find(args.vllm_router, "vllm-router") if args.vllm_router != "" else None
    with started(args.before, router) as proxies:
        results = await measure(proxies, rows, turns, args.window, args.rounds, args.tokens, args.grown)
        notes = []
        if args.profile:
            notes = await profile(proxies, rows, turns[-1], args.window, args.tokens, Path(args.profile))
    title = (
        f"CPU per request in the proxy process as one conversation grows ({args.rounds} rounds of "
        f"{args.window} requests per row and length, each "
        + ("grown turn by turn through the proxy" if args.grown else "resumed at one turn less")
        + "; instant backend)"
    )
    logic = f"The same over the floor of a hop ({BARE_HOP}: carrying the body) of the style and length:"
    return "\n".join([title, table(results), "", logic, over_floor_table(results), f"data: {source()}", *notes])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__)
    parser.add_argument("--turns", default=",".join(map(str, TURNS)), help="history lengths, comma-separated")
    parser.add_argument("--window", type=int, default=10, help="requests measured per row, length and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--styles",
        default="dify,agent",
        help=f"comma-separated: {', '.join(STYLES)} (messages: the Dify style on Anthropic's /v1/messages)",
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--tokens", type=int, default=8000, help="the Dify system prompt's size")
    parser.add_argument("--before", help="another checkout of prefix-proxy, measured beside this one")
    parser.add_argument("--profile", help="a folder for py-spy profiles at the longest length")
    parser.add_argument(
        "--vllm-router",
        help="the vllm-router executable, measured as a floor beside the bare stack (default: found; '' for none)",
    )
    parser.add_argument(
        "--grown",
        action="store_true",
        help="send every earlier turn first (untimed), not one resuming request: what the proxy keeps per turn",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    print(asyncio.run(run(parser().parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
