"""Answer fidelity on a real model: what the proxy rewrites must not change what the model knows.

    python -m bench.fidelity [--cache DIR] [--per-family 8] [--tools] [--families a,b] [--placements]

Families of requests the proxy rewrites, each answerable only from the text it moves:

- ``date_line``: ``Current date: <weekday>, <month> <day>, <year>.`` atop the system prompt; asked the weekday;
- ``date_asked`` (``--families``): the same line, asked the date (does the model read the moved line at all);
- ``retrieved_fact``: a Dify-style ``<context>`` block holding a door code atop the system prompt; asked the code;
- ``timestamped_chat``: a conversation whose system prompt opens with ``Current time: HH:MM:SS``; asked the time;
- ``shuffled_tools`` (``--tools``: llama-server runs ``--jinja --chat-template-file`` a ChatML template with
  tools, ``bench/llama_templates/chatml_tools.jinja``): the same tools in another order each request; asked
  which tool fits a task.

Each request is sent greedily (temperature 0) to a fresh llama-server directly, then to another fresh one
through a real ``prefix-proxy serve`` on its defaults. An answer is right when it holds the expected text.
Reported per family: right directly, right through the proxy, right->wrong (must be 0), wrong->right,
answers byte-identical, requests the proxy rewrote (``x-prefix-proxy-actions``) and, of those, answered
from the moved text (right through the proxy).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.llama_server import DEFAULT_CACHE, MODEL_NAME, ensure_engine, ensure_model, llama_server
from bench.servers import proxy

TOOLS_TEMPLATE = Path(__file__).resolve().parent / "llama_templates" / "chatml_tools.jinja"
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "March", "May", "July", "September", "November"]
MONTH_NUMBERS = {"January": 1, "March": 3, "May": 5, "July": 7, "September": 9, "November": 11}
PLACES = ["warehouse", "garage", "server room", "lab", "archive", "studio", "workshop", "cellar"]
TOOLS = [
    ("get_weather", "Get the current weather for a city", "find out whether it will rain in Paris"),
    ("send_email", "Send an email to a recipient", "write to my manager about tomorrow's meeting"),
    ("convert_currency", "Convert an amount between two currencies", "turn 100 dollars into euros"),
    ("book_flight", "Book a plane ticket between two airports", "fly from Boston to Denver on Friday"),
]
# What the proxy's actions header says when it rewrote a request's prompt.
REWRITES = ("volatile_moved", "tools_canonicalized", "query_blocks_restored")


@dataclass(frozen=True)
class Probe:
    family: str
    body: dict[str, Any]
    expected: str
    # Other spellings of the same answer (a date written 2025-09-08 for September 8).
    also: tuple[str, ...] = ()
    # Wrong answers of the same kind (the other weekdays): an answer that names one of them before
    # the expected one answered that one ("Today is Wednesday, which is a Monday" is not Monday).
    rivals: tuple[str, ...] = ()

    def answered_by(self, answer: str) -> bool:
        return any(is_right(answer, expected, self.rivals) for expected in (self.expected, *self.also))


def _chat(system: str, question: str, history: list[dict[str, str]] | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, *(history or []), {"role": "user", "content": question}]
    return {"model": MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 24}


def date_line(rng: random.Random) -> Probe:
    weekday = rng.choice(WEEKDAYS)
    date = f"{weekday}, {rng.choice(MONTHS)} {rng.randint(1, 28)}, 2025"
    system = f"Current date: {date}.\nYou are a helpful assistant for a travel agency. Answer in one short sentence."
    rivals = tuple(other for other in WEEKDAYS if other != weekday)
    return Probe("date_line", _chat(system, "What day of the week is it today?"), weekday, rivals=rivals)


def date_asked(rng: random.Random) -> Probe:
    """The same date line, asked the date itself: whether the moved line is read at all, apart from
    a weekday a small model often answers at chance whatever it reads."""
    month, day = rng.choice(MONTHS), rng.randint(1, 28)
    system = (
        f"Current date: {rng.choice(WEEKDAYS)}, {month} {day}, 2025.\n"
        "You are a helpful assistant for a travel agency. Answer in one short sentence."
    )
    iso = f"2025-{MONTH_NUMBERS[month]:02d}-{day:02d}"
    return Probe("date_asked", _chat(system, "What is today's date?"), f"{month} {day}", (iso,))


def retrieved_fact(rng: random.Random) -> Probe:
    place, code = rng.choice(PLACES), str(rng.randint(1000, 9999))
    system = (
        f"<context>\nThe door code for the {place} is {code}.\n</context>\n"
        "You are the facilities assistant. Use the context to answer. Answer in one short sentence."
    )
    return Probe("retrieved_fact", _chat(system, f"What is the door code for the {place}?"), code)


def timestamped_chat(rng: random.Random) -> Probe:
    clock = f"{rng.randint(10, 12)}:{rng.randint(10, 59)}:{rng.randint(10, 59)}"
    system = f"Current time: {clock}\nYou are a friendly assistant. Answer in one short sentence."
    history = [
        {"role": "user", "content": "Hi! I am planning my afternoon."},
        {"role": "assistant", "content": "Happy to help you plan your afternoon."},
    ]
    return Probe("timestamped_chat", _chat(system, "What time is it now, exactly?", history), clock)


def shuffled_tools(rng: random.Random) -> Probe:
    name, _, task = rng.choice(TOOLS)
    order = TOOLS[:]
    rng.shuffle(order)
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool,
                "description": description,
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
        for tool, description, _ in order
    ]
    system = "You are an assistant that picks tools. Answer with the name of one function only."
    body = _chat(system, f"Which function would you call to {task}?")
    body["tools"], body["tool_choice"] = tools, "none"
    return Probe("shuffled_tools", body, name)


FAMILIES: dict[str, Callable[[random.Random], Probe]] = {
    "date_line": date_line,
    "date_asked": date_asked,
    "retrieved_fact": retrieved_fact,
    "timestamped_chat": timestamped_chat,
    "shuffled_tools": shuffled_tools,
}


def probes(per_family: int, families: list[str], seed: int = 0) -> list[Probe]:
    rng = random.Random(seed)
    return [FAMILIES[family](rng) for family in families for _ in range(per_family)]


def is_right(answer: str, expected: str, rivals: tuple[str, ...] = ()) -> bool:
    """The answer names ``expected``, and no rival before it."""
    text = answer.lower()
    at = text.find(expected.lower())
    if at < 0:
        return False
    return not any(0 <= text.find(rival.lower()) < at for rival in rivals)


@dataclass
class FamilyScore:
    family: str
    requests: int = 0
    right_direct: int = 0
    right_proxy: int = 0
    right_to_wrong: int = 0
    wrong_to_right: int = 0
    identical: int = 0
    rewritten: int = 0
    rewritten_answered_from_moved_text: int = 0
    lost: list[str] = field(default_factory=list)  # the answers right directly and wrong through the proxy


def score(probes: list[Probe], direct: list[str], proxied: list[str], rewritten: list[bool]) -> dict[str, FamilyScore]:
    """Per family, the proxy's answers against direct's (pure)."""
    scores: dict[str, FamilyScore] = {}
    for probe, one, other, moved in zip(probes, direct, proxied, rewritten, strict=True):
        row = scores.setdefault(probe.family, FamilyScore(probe.family))
        right_direct, right_proxy = probe.answered_by(one), probe.answered_by(other)
        row.requests += 1
        row.right_direct += right_direct
        row.right_proxy += right_proxy
        row.identical += one == other
        row.rewritten += moved
        row.rewritten_answered_from_moved_text += moved and right_proxy
        if right_direct and not right_proxy:
            row.right_to_wrong += 1
            row.lost.append(f"expected {probe.expected!r}: direct {one!r}, proxy {other!r}")
        row.wrong_to_right += right_proxy and not right_direct
    return scores


def ask(base: str, probe: Probe, client: httpx.Client) -> tuple[str, bool]:
    response = client.post(base + "/chat/completions", json=probe.body)
    response.raise_for_status()
    actions = response.headers.get("x-prefix-proxy-actions", "")
    answer = response.json()["choices"][0]["message"].get("content") or ""
    return answer, any(kind in actions for kind in REWRITES)


def run_pass(base: str, asked: list[Probe]) -> tuple[list[str], list[bool]]:
    answers, rewritten = [], []
    with httpx.Client(timeout=600) as client:
        for probe in asked:
            answer, moved = ask(base, probe, client)
            answers.append(answer)
            rewritten.append(moved)
    return answers, rewritten


def placements(probe: Probe) -> dict[str, list[dict[str, Any]]]:
    """A probe whose system prompt opens with the line it asks about, that line put elsewhere, the
    text unchanged: atop the system prompt (as sent), in a system message of its own before the
    question (where the proxy moves it), at the system prompt's end, at the start of the question, in
    a user message of its own before the question, and in a system message of its own after the
    question (``relocate_target: after_last_user``); a probe's history (a timestamped chat's earlier
    turn) stays between the system prompt and the question."""
    messages = probe.body["messages"]
    system, question, history = messages[0]["content"], messages[-1]["content"], messages[1:-1]
    line, rest = system.split("\n", 1)
    asked = {"role": "user", "content": question}
    return {
        "atop_system": [{"role": "system", "content": system}, *history, asked],
        "own_system_message": [
            {"role": "system", "content": rest},
            *history,
            {"role": "system", "content": line},
            asked,
        ],
        "system_end": [{"role": "system", "content": f"{rest}\n{line}"}, *history, asked],
        "user_start": [
            {"role": "system", "content": rest},
            *history,
            {"role": "user", "content": f"{line}\n\n{question}"},
        ],
        "own_user_message": [{"role": "system", "content": rest}, *history, {"role": "user", "content": line}, asked],
        "after_question": [{"role": "system", "content": rest}, *history, asked, {"role": "system", "content": line}],
    }


def run_placements(base: str, asked: list[Probe]) -> dict[str, FamilyScore]:
    """Per placement, its answers (sent directly) scored as :func:`score` scores the proxy's against
    direct's, against the line as sent (``atop_system``), every family together."""
    answers: dict[str, list[str]] = {}
    with httpx.Client(timeout=600) as client:
        for probe in asked:
            for name, messages in placements(probe).items():
                moved = Probe(probe.family, {**probe.body, "messages": messages}, probe.expected, probe.also)
                answers.setdefault(name, []).append(ask(base, moved, client)[0])
    together = [replace(probe, family="placements") for probe in asked]
    unmoved = [False] * len(asked)
    return {
        name: score(together, answers["atop_system"], placed, unmoved)["placements"] for name, placed in answers.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--per-family", type=int, default=8)
    parser.add_argument(
        "--tools", action="store_true", help="add shuffled_tools (llama-server --jinja, a tools template)"
    )
    parser.add_argument("--families", help="comma-separated families (default: all but shuffled_tools)")
    parser.add_argument(
        "--placements",
        action="store_true",
        help="no proxy: the families' moved line sent directly in four places (date_line by default)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    binary, model = ensure_engine(args.cache), ensure_model(args.cache)
    if args.placements:
        asked = probes(args.per_family, (args.families or "date_line").split(","))
        with llama_server(binary, model, 4096) as server:
            right = run_placements(server + "/v1", asked)
        print(f"llama-server, {MODEL_NAME}, greedy; {len(asked)} requests, answered right with the line:")
        print(f"  {'placement':20} {'right':>7}  right->wrong  wrong->right (against atop_system)")
        for name, placed in right.items():
            print(
                f"  {name:20} {placed.right_proxy:3} / {len(asked):<3} {placed.right_to_wrong:12}"
                f" {placed.wrong_to_right:13}"
            )
        return 0
    families = ["date_line", "retrieved_fact", "timestamped_chat"] + (["shuffled_tools"] if args.tools else [])
    if args.families:
        families = args.families.split(",")
    asked = probes(args.per_family, families)
    extra = ["--jinja", "--chat-template-file", str(TOOLS_TEMPLATE)] if args.tools else []
    with llama_server(binary, model, 4096, extra=extra) as server:
        direct, _ = run_pass(server + "/v1", asked)
    with llama_server(binary, model, 4096, extra=extra) as server, proxy(server + "/v1") as base:
        proxied, rewritten = run_pass(base, asked)
    scores = score(asked, direct, proxied, rewritten)
    print(f"llama-server, {MODEL_NAME}, greedy; {args.per_family} requests per family:")
    print(f"  {'family':17} right direct  right proxy  right->wrong  wrong->right  identical  rewritten  from moved")
    for row in scores.values():
        print(
            f"  {row.family:17} {row.right_direct:12} {row.right_proxy:12} {row.right_to_wrong:13} "
            f"{row.wrong_to_right:13} {row.identical:10} {row.rewritten:10} {row.rewritten_answered_from_moved_text:11}"
        )
        for lost in row.lost:
            print("      LOST " + lost)
    if args.json:
        print(json.dumps([asdict(row) for row in scores.values()]))
        answers = zip(asked, direct, proxied, rewritten, strict=True)
        print(json.dumps([[p.family, p.expected, one, other, moved] for p, one, other, moved in answers]))
    return 0 if all(row.right_to_wrong == 0 for row in scores.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
