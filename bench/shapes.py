"""Request shapes for the hop benchmarks: what real clients send, built from real prompts.

Each shape makes request ``i`` of a deterministic sequence (``Shape.body(i)``); every path of a
benchmark gets the same sequence, so the proxies under test see the same traffic. The shapes:

- ``oneline``: one user message, a filler sentence repeated to ``tokens`` (the benchmark's old
  prompt; a new salt in front on every request);
- ``dify``: a Dify app: a multi-line system prompt of ``tokens`` made of real Dify system prompts
  (placeholders filled once), with one line that changes on every request (the current time, as a
  workflow's code node fills it), and seven different user questions (MT-bench), one a request;
- ``dify-same``: the same with the system prompt identical on every request (the time line fixed);
- ``agent20``: a function-calling agent on chat completions: a Dify system prompt, 21 BFCL tools,
  and conversations of 20 turns (each turn a user request, an assistant tool call, its result and
  the answer), one request per turn, each carrying the whole conversation so far;
- ``claude-code``: a Claude-Code-sized ``/v1/messages`` request: system blocks (an attribution
  block with a per-request hash, the identity, long instructions with an environment block and git
  status), 20 coding tools and 12 more (MCP-style, BFCL schemas), user turns with
  ``<system-reminder>`` blocks, and conversations of 20 requests with ``tool_use`` /
  ``tool_result`` blocks and the moving ``cache_control`` breakpoint; streamed, as the client does;
- ``openwebui``: Open WebUI: a real instruction with its variables (date, time to the second,
  weekday, user) mid-prompt, the chat id header, the RAG template on the last user message, the
  ``user`` field, streamed; chats of 4 turns;
- ``new-system``: the worst case: the ``dify`` prompt with every line made new on every request
  (a different app each time): nothing of it was seen before.

Real data: ``/work/shared/data`` (or ``$PREFIX_PROXY_BENCH_DATA``, or ``shared/data`` beside the
checkout) when present: the 76 distinct Dify system prompts, the BFCL tool suites and the MT-bench
questions. Without it, the subset bundled with the workload (``testbed/workload/data``: 11 Dify
nodes, two tool suites, 32 questions), its prompts repeated with numbered part headings until the
prompt has the same size; ``Shapes.source`` says which.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

from proxy.tokenization import load_encoding
from testbed.workload.scenarios import coding_agent

MODEL = "fake-model"
FILLER = (
    "The quarterly report covers revenue, margins, inventory turnover and regional performance. "
    "Each section lists the figures, the change against last quarter and the reasons given by managers. "
)
SHAPE_NAMES = ("oneline", "dify", "dify-same", "agent20", "claude-code", "openwebui", "new-system")
REAL_SHAPES = SHAPE_NAMES[1:]
EPOCH = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
_PLACEHOLDER = re.compile(r"\{\{#([^#{}]+)#\}\}")
_BUNDLED = Path(__file__).resolve().parents[1] / "testbed" / "workload" / "data"


def tokens_of(text: str) -> int:
    return len(load_encoding().encode_ordinary(text))


# -- the data --------------------------------------------------------------------------------------


def data_dir() -> Path | None:
    """The real data set (see the module's docstring), or None."""
    candidates = [os.environ.get("PREFIX_PROXY_BENCH_DATA", "")]
    candidates += [str(Path(__file__).resolve().parents[2] / "shared" / "data"), "/work/shared/data"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "dify_prompts.jsonl").is_file():
            return Path(candidate)
    return None


@dataclass(frozen=True)
class Corpus:
    source: str
    dify_systems: tuple[str, ...]
    questions: tuple[tuple[str, ...], ...]
    tool_suites: dict[str, list[dict[str, Any]]] = field(hash=False)


@cache
def corpus() -> Corpus:
    found = data_dir()
    root = found or _BUNDLED
    systems: list[str] = []
    for line in (root / "dify_prompts.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            text = next((m["text"] for m in record["messages"] if m["role"] == "system"), "")
            if text.strip() and text not in systems:
                systems.append(text)
    questions = tuple(
        tuple(json.loads(line)["turns"])
        for line in (root / "mt_bench_questions.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    )
    suites = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted((root / "tools").glob("*.json"))}
    if found is not None:
        source = f"real data from {found}: {len(systems)} Dify system prompts, {len(suites)} BFCL tool suites"
    else:
        source = (
            f"{root} (the workload's bundled subset: {len(systems)} Dify system prompts, repeated with part "
            f"headings to size; {len(suites)} tool suites): /work/shared/data not found"
        )
    return Corpus(source, tuple(systems), questions, suites)


def _fill(text: str) -> str:
    """Every ``{{#...#}}`` placeholder filled with a fixed value, as one app's run fills it."""
    return _PLACEHOLDER.sub(lambda m: f"[{m.group(1).rsplit('.', 1)[-1]}: value set by the app]", text)


@cache
def dify_prompt(tokens: int) -> tuple[str, ...]:
    """Lines of a system prompt of about ``tokens``: real Dify system prompts one after the other,
    those with most lines per token first (a long prompt is many short lines: lists, steps, rules),
    repeated under part headings when the data set holds fewer."""
    filled = [_fill(s) for s in corpus().dify_systems]
    systems = sorted(filled, key=lambda s: -(s.count("\n") + 1) / max(1, tokens_of(s)))
    parts: list[str] = []
    total = 0
    index = 0
    while total < tokens:
        text = systems[index % len(systems)]
        if index >= len(systems):
            text = f"## Part {index // len(systems) + 1}\n{text}"
        parts.append(text)
        total += tokens_of(text) + 1
        index += 1
    return tuple("\n\n".join(parts).split("\n"))


def _tools(*suites: str) -> list[dict[str, Any]]:
    found = corpus().tool_suites
    return [tool for suite in suites if suite in found for tool in found[suite]]


# -- the shapes ------------------------------------------------------------------------------------


@dataclass
class Shape:
    name: str
    path: str  # under the /v1 base URL
    description: str
    make: Callable[[int], dict[str, Any]]
    headers_of: Callable[[int], dict[str, str]] | None = None
    # Requests per conversation (1: every request stands alone); a phase starts at a conversation.
    conversation: int = 1
    stream: bool = False

    def body(self, i: int) -> dict[str, Any]:
        return self.make(i)

    def headers(self, i: int) -> dict[str, str] | None:
        return self.headers_of(i) if self.headers_of else None

    def phase_start(self, phase: int) -> int:
        """The first index of a measurement phase: far from the others', at a conversation's start."""
        return phase * 1_000_000 * self.conversation


def oneline(tokens: int) -> Shape:
    unit = tokens_of(FILLER)
    prompt = FILLER * max(1, tokens // unit)

    def make(i: int) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": f"{i} {prompt}"}]}

    shape = Shape("oneline", "/chat/completions", f"one user message of {tokens:,} tokens (filler)", make)
    return shape


def _clock(i: int) -> datetime:
    return EPOCH + timedelta(seconds=7 * i)


def dify(tokens: int, varying: bool = True) -> Shape:
    lines = list(dify_prompt(tokens))
    questions = [q[0] for q in corpus().questions[:7]]
    # After the first prompt's first paragraph, as a workflow's code node output sits in a prompt.
    at = lines.index("") if "" in lines else 1

    def make(i: int) -> dict[str, Any]:
        now = _clock(i if varying else 0)
        line = f"当前时间：{now:%Y-%m-%d %H:%M:%S}（{'一二三四五六日'[now.weekday()]}）"
        system = "\n".join([*lines[:at], line, *lines[at:]])
        user = questions[i % len(questions)]
        return {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }

    shape = Shape(
        "dify" if varying else "dify-same",
        "/chat/completions",
        f"Dify app: {len(lines) + 1}-line system prompt, "
        f"{'one line new per request' if varying else 'the same every request'}, 7 questions",
        make,
    )
    return shape


def new_system(tokens: int) -> Shape:
    lines = list(dify_prompt(tokens))
    questions = [q[0] for q in corpus().questions[:7]]

    def make(i: int) -> dict[str, Any]:
        # Every non-blank line carries the request's own mark: no line was sent before.
        system = "\n".join(f"{line} ·{i:x}" if line.strip() else line for line in lines)
        return {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": questions[i % 7]}],
        }

    shape = Shape("new-system", "/chat/completions", f"a new {len(lines)}-line system prompt every request", make)
    return shape


# BFCL-style requests and results for the agent's turns (written for this benchmark).
_AGENT_TASKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("send_message", {"receiver_id": "USR003", "message": "The design review moved to Thursday at 10."}),
    ("view_messages_sent", {}),
    ("search_messages", {"keyword": "quarterly budget"}),
    ("create_ticket", {"title": "VPN disconnects every 10 minutes", "description": "Since Monday.", "priority": 4}),
    ("get_ticket", {"ticket_id": 7423}),
    ("search_engine_query", {"prompt": "latest release notes of the VPN client", "max_results": 3}),
    ("add_contact", {"user_name": "Maya"}),
    ("resolve_ticket", {"ticket_id": 2210, "resolution": "Replaced the faulty docking station."}),
)


def _agent_result(conversation: int, turn: int, name: str) -> str:
    rows = [
        {"id": f"{name[:3].upper()}{conversation % 997:03d}{turn:02d}{n}", "status": "ok", "detail": f"{name} item {n}"}
        for n in range(6)
    ]
    return json.dumps({"result": rows, "count": len(rows), "elapsed_ms": 12 + turn})


def agent_system() -> str:
    """The function-calling agent's system prompt: the longest of the first 20 Dify prompts."""
    return _fill(max(corpus().dify_systems[:20], key=len))


def agent_tools() -> list[dict[str, Any]]:
    """The agent's 21 tools (BFCL's message, ticket and web-search suites)."""
    return _tools("message_api", "ticket_api", "web_search")


def agent_turn(conversation: int, turn: int, question: str) -> list[dict[str, Any]]:
    """One finished turn of the agent's conversation: the user's ``question``, the assistant's tool
    call, the tool's result and the assistant's answer."""
    name, arguments = _AGENT_TASKS[(conversation + turn) % len(_AGENT_TASKS)]
    call_id = f"call_{hashlib.sha1(f'{conversation}:{turn}'.encode()).hexdigest()[:24]}"
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": _agent_result(conversation, turn, name)},
        {"role": "assistant", "content": f"Done: {name} answered with 6 items for turn {turn}."},
    ]


def agent20() -> Shape:
    system = agent_system()
    tools = agent_tools()
    questions = [turn for q in corpus().questions for turn in q]
    turns = 20

    def history(conversation: int, upto: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in range(upto + 1):
            question = questions[(conversation * 3 + turn) % len(questions)]
            opening = f"(chat {conversation}) " if turn == 0 else ""
            if turn == upto:
                messages.append({"role": "user", "content": f"{opening}{question}"})
                break
            messages += agent_turn(conversation, turn, f"{opening}{question}")
        return messages

    def make(i: int) -> dict[str, Any]:
        messages = history(i // turns, i % turns)
        return {"model": MODEL, "max_tokens": 16, "tools": tools, "tool_choice": "auto", "messages": messages}

    shape = Shape(
        "agent20", "/chat/completions", f"function-calling agent, {len(tools)} tools, 20-turn conversations", make
    )
    shape.conversation = turns
    return shape


_REMINDER_TODO = (
    "<system-reminder>\nThis is a reminder that your todo list is currently empty. DO NOT mention this to the "
    "user explicitly because they are already aware. If you are working on tasks that would benefit from a todo "
    "list please use the TodoWrite tool to create one. If not, please feel free to ignore. Again do not mention "
    "this message to the user.\n</system-reminder>"
)
_CLAUDE_MD = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\n"
    "Codebase and user instructions are shown below. Be sure to adhere to these instructions.\n\n"
    "Contents of /home/dev/src/{repo}/CLAUDE.md (project instructions, checked into the codebase):\n\n"
    "# Development\n- Run `make test` before committing; `make lint` runs ruff and mypy.\n"
    "- Keep functions small; every public function has a docstring and type hints.\n"
    "- Database migrations go in migrations/, one per change, never edited after merge.\n"
    "- Use the shared retry helper in src/core/retry.py for every outbound call.\n\n"
    "# Style\n- Line length 120.\n- Imports sorted by ruff; no wildcard imports.\n\n"
    "      IMPORTANT: this context may or may not be relevant to your tasks. You should not respond to this "
    "context unless it is highly relevant to your task.\n</system-reminder>"
)


def _anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "name": f"mcp__bfcl__{function['name']}",
        "description": function["description"],
        "input_schema": function["parameters"],
    }


def claude_code() -> Shape:
    tools = [*coding_agent.TOOLS, *(_anthropic_tool(t) for t in _tools("gorilla_file_system", "message_api")[:12])]
    rounds = 20
    files = coding_agent.FILES

    def instructions(conversation: int) -> str:
        repo = coding_agent.REPOS[conversation % len(coding_agent.REPOS)]
        date = f"2026-{1 + conversation // 28 % 12:02d}-{1 + conversation % 28:02d}"
        status = "\n".join(f" M {files[(conversation + n) % len(files)]}" for n in range(3))
        commits = "\n".join(
            f"{hashlib.sha1(f'{conversation}:{n}'.encode()).hexdigest()[:7]} "
            f"{coding_agent.COMMIT_MESSAGES[(conversation + n) % len(coding_agent.COMMIT_MESSAGES)]}"
            for n in range(5)
        )
        branch = coding_agent.BRANCHES[conversation % len(coding_agent.BRANCHES)]
        git = coding_agent.GIT_TEMPLATE.format(branch=branch, status=status, commits=commits)
        env = coding_agent.ENV_TEMPLATE.format(cwd=f"/home/dev/src/{repo}", date=date)
        return f"{coding_agent.INSTRUCTIONS}\n{env}\n\n{git}"

    def tool_result(conversation: int, step: int) -> str:
        path = files[(conversation + step) % len(files)]
        lines = [
            f"{n:6d}\t{line.format(name=f'handle_item_{n}', thing='payment')}"
            for n, line in enumerate(coding_agent._CODE_LINES * 8, start=1)
        ]
        return f"/home/dev/src/{path}\n" + "\n".join(lines)

    def make(i: int) -> dict[str, Any]:
        conversation, step = divmod(i, rounds)
        repo = coding_agent.REPOS[conversation % len(coding_agent.REPOS)]
        task = coding_agent.TASKS[conversation % len(coding_agent.TASKS)]
        first = [
            {"type": "text", "text": _CLAUDE_MD.format(repo=repo)},
            {"type": "text", "text": f"{task} (session {conversation})"},
            {"type": "text", "text": _REMINDER_TODO},
        ]
        messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
        for n in range(step):
            call_id = f"toolu_{hashlib.sha1(f'{conversation}:{n}'.encode()).hexdigest()[:24]}"
            path = f"/home/dev/src/{repo}/{files[(conversation + n) % len(files)]}"
            use = {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": path}}
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Reading {path}."}, use]})
            result = {"type": "tool_result", "tool_use_id": call_id, "content": tool_result(conversation, n)}
            content: list[dict[str, Any]] = [result]
            if n % 5 == 4:
                content.append({"type": "text", "text": _REMINDER_TODO})
            messages.append({"role": "user", "content": content})
        messages = copy.deepcopy(messages)
        messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        stamp = hashlib.sha1(f"{conversation}:{step}".encode()).hexdigest()[:5]
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.14; cch={stamp};"},
            {"type": "text", "text": coding_agent.IDENTITY},
            {"type": "text", "text": instructions(conversation), "cache_control": {"type": "ephemeral"}},
        ]
        return {
            "model": MODEL,
            "max_tokens": 32000,
            "stream": True,
            "system": system,
            "tools": tools,
            "metadata": {"user_id": f"user_{conversation:04d}_account_session"},
            "messages": messages,
        }

    shape = Shape(
        "claude-code",
        "/messages",
        f"Claude Code on /v1/messages: system blocks, {len(tools)} tools, reminders, 20-request sessions",
        make,
        stream=True,
    )
    shape.conversation = rounds
    return shape


_OWUI_RAG = (
    "### Task:\nRespond to the user query using the provided context, incorporating inline citations in the "
    'format [id] **only when the <source> tag includes an explicit id attribute** (e.g., <source id="1">).\n\n'
    "### Guidelines:\n- If you don't know the answer, clearly state that.\n"
    "- If uncertain, ask the user for clarification.\n- Respond in the same language as the user's query.\n"
    "- If the context is unreadable or of poor quality, inform the user and provide the best possible answer.\n"
    "- **Only include inline citations using [id] (e.g., [1], [2]) when the <source> tag includes an id "
    "attribute.**\n\n### Output:\nProvide a clear and direct response to the user's query, including inline "
    "citations in the format [id] only when the <source> tag with id attribute is present in the context.\n\n"
    "<context>\n{context}\n</context>\n\n<user_query>\n{query}\n</user_query>"
)


def openwebui() -> Shape:
    systems = [_fill(s) for s in corpus().dify_systems]
    head, _, tail = max(systems[:12], key=len).partition("\n\n")
    passages = [p.strip() for s in systems for p in s.split("\n\n") if 200 <= len(p.strip()) <= 900]
    questions = corpus().questions
    turns = 4
    users = ("Alice Chen", "Bob Martinez", "Priya Nair", "Jonas Weber")

    def make(i: int) -> dict[str, Any]:
        chat, turn = divmod(i, turns)
        now = _clock(i)
        user = users[chat % len(users)]
        variables = (
            f"You are talking to {user}.\nToday is {now:%A}, {now:%Y-%m-%d}; the local time is {now:%I:%M:%S %p}."
        )
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"{head}\n\n{variables}\n\n{tail}"}]
        asked = [t for q in questions[chat % 20 :] for t in q][: turn + 1]
        for n, query in enumerate(asked):
            text = f"(chat {chat}) {query}" if n == 0 else query
            if n == turn:
                context = "\n".join(
                    f'<source id="{k + 1}">{passages[(chat + n + k) % len(passages)]}</source>' for k in range(3)
                )
                text = _OWUI_RAG.format(context=context, query=text)
            messages.append({"role": "user", "content": text})
            if n < turn:
                messages.append({"role": "assistant", "content": f"Here is what I found about it (turn {n})."})
        return {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": f"owui-{user.split()[0].lower()}",
            "messages": messages,
        }

    def headers(i: int) -> dict[str, str]:
        return {"X-OpenWebUI-Chat-Id": hashlib.md5(str(i // turns).encode()).hexdigest()}

    shape = Shape(
        "openwebui",
        "/chat/completions",
        "Open WebUI: variables mid-prompt, RAG on the last turn, 4-turn chats",
        make,
        headers,
        stream=True,
    )
    shape.conversation = turns
    return shape


def _units(body: dict[str, Any]) -> list[str]:
    """A request as the pieces a proxy can know from before: each line of a system text, each other
    message, each tool, each other field (as JSON)."""
    units: list[str] = []
    system = body.get("system")
    blocks = [system] if isinstance(system, str) else [b.get("text", "") for b in system or []]
    for message in body.get("messages", []):
        if message.get("role") == "system" and isinstance(message.get("content"), str):
            blocks.append(message["content"])
        else:
            units.append(json.dumps(message, ensure_ascii=False))
    units += [line for text in blocks for line in text.split("\n") if line.strip()]
    units += [json.dumps(tool, ensure_ascii=False) for tool in body.get("tools", [])]
    units += [json.dumps({k: v}) for k, v in body.items() if k not in ("system", "messages", "tools")]
    return units


@dataclass(frozen=True)
class Size:
    prompt_tokens: int  # a request's JSON, on average
    new_tokens: int  # of those, in pieces the request before it did not hold (``_units``)


def size(shape: Shape, sample: int = 40) -> Size:
    """Average size of requests ``1..sample`` of the sequence, and how much of each is new."""
    total = new = 0
    previous = set(_units(shape.body(0)))
    for i in range(1, sample + 1):
        body = shape.body(i)
        units = _units(body)
        total += tokens_of(json.dumps(body, ensure_ascii=False))
        new += sum(tokens_of(u) for u in units if u not in previous)
        previous = set(units)
    return Size(total // sample, new // sample)


def build(name: str, tokens: int) -> Shape:
    makers: dict[str, Callable[[], Shape]] = {
        "oneline": lambda: oneline(tokens),
        "dify": lambda: dify(tokens),
        "dify-same": lambda: dify(tokens, varying=False),
        "agent20": agent20,
        "claude-code": claude_code,
        "openwebui": openwebui,
        "new-system": lambda: new_system(tokens),
    }
    if name not in makers:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPE_NAMES)}")
    return makers[name]()


def parse(names: str) -> list[str]:
    """``all``, ``real`` (every shape but ``oneline``) or a comma-separated list."""
    if names == "all":
        return list(SHAPE_NAMES)
    if names == "real":
        return list(REAL_SHAPES)
    return [n.strip() for n in names.split(",") if n.strip()]
