"""Recorded sessions of real clients, replayed through a real proxy against the fake vLLM (issue 44).

Each recording in tests/recorded/ holds the requests a client installed from its registry sent in one
session (``python -m bench.clients --scenarios edits``: uncommitted edits after the first and the third
turn, so the environment the clients report changes mid-session), saved by ``bench.clients.replay``:

- Continue CLI (``@continuedev/cli`` 1.5.47, ``cn -p`` then ``cn -p --resume``): a system prompt with a
  ``Notes:`` list, an ``<env>`` element (working directory, date) and ``<context name="gitStatus">``;
- a pydantic-ai agent (``pydantic-ai-slim`` 2.68.0, bench/clients/pydantic_agent.py): instructions whose
  dynamic part is ``Working directory:``, ``Current time:`` and ``Git status:`` with ``git status --short``
  (pydantic-ai sends each instruction part as a system message of its own);
- and Continue CLI again with nothing changing between turns (``--scenarios plain``);
- an OpenAI Agents SDK agent (``openai-agents`` 0.24.0, bench/clients/openai_agents.py) on ``/v1/responses``
  with ``store`` false: instructions whose last part is a ``## Environment`` section (a list with the
  working directory, an ISO clock and ``Git status:`` before a fence of ``git status --short``), the history
  re-sent as ``to_input_list()`` gives it;
- a LangGraph ReAct agent (``langgraph`` 1.2.24, ``langchain-openai`` 1.8.1, bench/clients/langgraph_agent.py):
  a ``ChatPromptTemplate`` system prompt with a clock at its second line and the retrieved documents after
  ``Context:`` at its end (a README that opens with a Markdown heading, code);
- a smolagents ``ToolCallingAgent`` (``smolagents`` 1.26.0, bench/clients/smolagents_agent.py): the system
  prompt smolagents builds (its tool-calling template with the tools rendered in, nothing volatile), the
  memory carried across turns (``run(reset=False)``), text replies answered by smolagents' own "Error while
  parsing tool call" observations and a final-answer request, three requests a turn;
- a LlamaIndex ``ContextChatEngine`` (``llama-index-core`` 0.14.25, ``llama-index-llms-openai-like`` 0.8.1,
  bench/clients/llamaindex_agent.py): one system message, LlamaIndex's context template (retrieved files as
  ``file_path:`` nodes between dashed rules) then our prompt ending with a clock line;
- two coding agents first run in session 29 (``python -m bench.clients --clients kilo-code,mistral-vibe
  --scenarios edits``): Kilo Code CLI (``@kilocode/cli`` 7.7.7, ``kilo run`` then ``--continue``), whose
  system prompt holds an ``<env>`` element with the date and its config paths, each user turn ending
  with an ``<environment_details>`` block; and mistral-vibe (``mistral-vibe`` 3.0.2, ``vibe -p`` then
  ``-c``), whose prompt holds the date, the absolute path and a ``gitContext:`` line heading the git
  lines, and whose tool schemas come in another key order in each new process;
- three clients first run after session 29 (``python -m bench.clients --clients pi,agno,gptme --scenarios edits``):
  pi (``@mariozechner/pi-coding-agent`` 0.73.1, ``pi -p`` then ``-c``), whose system prompt ends with a
  ``Pi documentation (...):`` list of its install paths then ``Current date:`` and ``Current working
  directory:``; an agno agent (``agno`` 3.1.10, bench/clients/agno_agent.py) whose system message holds
  agno's ``<additional_information>`` clock (``add_datetime_to_context``) and our working directory and
  ``Git status:``, the history kept by agno's ``SqliteDb``; and gptme (``gptme`` 0.35.1, ``gptme -n
  --name``), three system messages (its 24k-token tool prompt, a cache-boundary note, then system
  information, the date and ``## Git Status``) kept as logged at the session's start;
- three agent frameworks first run in session 31 (docs/clients.md): mini-swe-agent (``mini-swe-agent``
  2.4.6: its machine's ``uname`` in the first user message, observations as user messages); an AutoGen
  ``AssistantAgent`` (``autogen-agentchat`` 0.7.5) with a ``BufferedChatCompletionContext`` of 4 messages,
  a sliding window without a session header that the proxy repairs (``WINDOW_REPAIRED``), its system
  message holding the working directory, the time and the git status; and a CrewAI ``Agent`` (``crewai``
  1.15.30) with those facts in its backstory, two tasks a turn, once on native tool calls and once
  through LiteLLM's ReAct text (``crewai-react``);
- two agents whose system prompt changes mid-conversation (docs/clients.md): deepagents (``deepagents``
  0.7.32, a list-of-parts system message with our environment section, its to-do list and its
  ``<agent_memory>``, once with the memory growing every turn) and Letta Code (``letta`` 0.34.12, local
  mode: a ``<memory_update>`` block appended to its system prompt by a committed memory edit; it asks
  ``GET /v1/models`` before every turn);
- and each agent again recorded with the fake's tool-calling replies (``--policy-replies``: a tool call then
  text every turn, so two requests a turn; replayed with text replies like every recording, the tool calls
  in the history are the client's text).

Each is replayed, in order, to a fresh fake vLLM directly and to another through a fresh in-process proxy
(uvicorn, defaults), the fake answering what it answered when recorded. Through the proxy: every request
answered, no unit of the client's system text torn (``bench.clients.audit.torn_units``: a label without
what it introduces, an element emptied or split, a listing split), no line lost, no text the client did
not send (in its request, or for a repaired window in its session), and no more prefill than directly
(the backend's own counters). No network, no client needed.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from bench.clients.audit import audit, moved_lines, system_texts, torn_units
from bench.clients.recorder import Exchange
from bench.clients.replay import Replay, load, replay
from bench.clients.run import GENERATION_PATHS

RECORDED = Path(__file__).parent / "recorded"
SESSIONS = (
    "continue-cli-edits",
    "pydantic-ai-edits",
    "continue-cli-plain",
    "openai-agents-edits",
    "openai-agents-tools",
    "langgraph-edits",
    # Its first rewrite comes at its seventh request (the clock's place varied by then): the shadow
    # judged the trial on it with the six as-sent requests before it and stopped rewriting (3,536
    # against 3,494 directly) until a trial's window counted only the requests it changed.
    "langgraph-tools",
    "smolagents-edits",
    "smolagents-tools",
    "llamaindex-edits",
    "kilo-code-edits",
    "mistral-vibe-edits",
    "pi-edits",
    "agno-edits",
    "gptme-edits",
    "mini-swe-agent-plain",
    "mini-swe-agent-edits",
    "autogen-plain",
    "autogen-edits",
    "autogen-tools",
    "autogen-long",
    "crewai-plain",
    "crewai-edits",
    "crewai-tools",
    "crewai-react-plain",
    "crewai-react-edits",
    # deepagents: the clock in the first text part of a list-of-parts system message (0.22x direct); its
    # memory (<agent_memory>, the last part) grows each turn (0.59x); a tool call then text each turn.
    "deepagents-edits",
    "deepagents-memory-edits",
    "deepagents-tools",
    # Letta Code: nothing moves (1.00x); a committed memory edit appends <memory_update> to the end of
    # the system prompt, after the tools' place (0.41x: 66,203 direct, 27,333 through the proxy).
    "letta-edits",
    "letta-memory-edits",
)
# AutoGen's BufferedChatCompletionContext sends the system message and the last 4 messages, no session
# header: once its window slides, the proxy restores what it dropped from the session's remembered tail
# (summarizer.sliding_window_repair, default "inferred": docs/summarizer.md), so a request holds text
# its own client request did not; every line of it the client sent earlier in the session.
WINDOW_REPAIRED = {"autogen-plain", "autogen-edits", "autogen-long"}
# Nothing in the system prompt smolagents builds varies (no clock, no directory, no status): the proxy
# forwards its requests' system text as sent. gptme writes its date, directory and git status once, at the
# session's start, and re-sends them as logged (its Markdown-bold keys read as no environment facts).
# mini-swe-agent writes its machine's facts in the first user message.
NOTHING_TO_MOVE = {
    "smolagents-edits",
    "smolagents-tools",
    "gptme-edits",
    "mini-swe-agent-plain",
    "mini-swe-agent-edits",
    # Letta Code's system prompt holds no environment (its <system-reminder> blocks are in the user turn)
    # and nothing in it changes while its memory does not.
    "letta-edits",
}
# Continue CLI with nothing changing between turns: the environment block moves at the first request
# (an environment span moves at first sight) into a system message of its own, whose role framing
# adds 5 prompt tokens to every request; nothing in the session varies, so nothing pays it back.
FRAMING_COSTS_MORE = pytest.mark.xfail(
    strict=True,
    reason="proxy.canon.relocation._varied_spans moves FIRST_SIGHT_KINDS (proxy.canon.volatile: 'environment') "
    "at a conversation's first request, into a system message of its own (about 5 prompt tokens of role framing); "
    "in a session where the environment never changes nothing pays it back (issue 44, defect 1's framing; each "
    "case's figures beside it)",
)
# The sessions that cost more than directly by that framing, against their direct figures: Continue
# plain, Kilo Code (its <env> element moves at first sight like Continue's: 12,683 against 12,663, 5
# tokens a request) and pi (its date and working directory, and two install paths of its docs list read
# as environment facts: 1,540 against 1,524, 4 tokens a request).
FRAMING_CASES = {"continue-cli-plain", "kilo-code-edits", "pi-edits"}
PREFILL_CASES = [pytest.param(name, marks=FRAMING_COSTS_MORE) if name in FRAMING_CASES else name for name in SESSIONS]


@functools.cache
def _session(name: str) -> tuple[dict[str, Any], Replay, Replay]:
    recording = load(RECORDED / f"{name}.json")
    return recording, replay(recording, "direct"), replay(recording, "proxy")


def _moves(recording: dict[str, Any], proxied: Replay) -> int:
    """How many forwarded requests had lines of the client's system text moved."""
    count = 0
    generations = [r for r in recording["requests"] if r["path"].split("?")[0] in GENERATION_PATHS]
    for sent, got in zip(generations, proxied.backend_requests, strict=True):
        forwarded = system_texts(got["path"], got["body"])
        texts = system_texts(sent["path"], sent["body"])
        count += any(moved_lines(text, forwarded, i)[0] for i, text in enumerate(texts))
    return count


@pytest.mark.parametrize("name", SESSIONS)
def test_replay_through_the_proxy_tears_no_unit(name: str) -> None:
    recording, direct, proxied = _session(name)
    assert proxied.statuses == [200] * len(recording["requests"]), proxied.statuses
    assert direct.statuses == proxied.statuses
    if name in NOTHING_TO_MOVE:
        assert _moves(recording, proxied) == 0
    else:  # the session exercises relocation: the check below has moves to judge
        assert _moves(recording, proxied) >= 1
    assert proxied.torn == [], json.dumps(proxied.torn, indent=1, ensure_ascii=False)
    assert proxied.foreign_in_session == [], proxied.foreign_in_session
    if name in WINDOW_REPAIRED:
        assert proxied.foreign, "the window never slid: the recording no longer exercises the repair"
    else:
        assert proxied.foreign == [], proxied.foreign


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_replay_through_the_proxy_costs_no_more_than_direct(name: str) -> None:
    recording, direct, proxied = _session(name)
    assert direct.prompt_tokens > 0 and direct.foreign == [] and direct.torn == []
    assert proxied.prefill <= direct.prefill, (recording["client"], direct.prefill, proxied.prefill)


def _exchange(seq: int, body: dict[str, Any]) -> Exchange:
    return Exchange(seq, "POST", "/v1/chat/completions", {}, json.dumps(body).encode())


def test_the_check_finds_a_label_left_without_its_content() -> None:
    """What the proxy forwarded before relocation moved whole units (issue 44, defect 2): the agent's
    ``Git status:`` label and the facts above it moved before the last user turn, its ``clean`` left
    behind as a system message of its own (pydantic-ai sends each instruction part as one)."""
    sent = load(RECORDED / "pydantic-ai-edits.json")["requests"][0]["body"]
    system = sent["messages"][1]["content"]
    assert system.endswith("Git status:\nclean")
    lines = system.split("\n")
    moved = [line for line in lines if line.startswith(("Working directory:", "Current time:", "Git status:"))]
    forwarded = copy.deepcopy(sent)
    forwarded["messages"][1]["content"] = "\n".join(line for line in lines if line not in moved)
    forwarded["messages"].insert(-1, {"role": "system", "content": "\n".join(moved)})
    findings = torn_units([(_exchange(0, forwarded), _exchange(0, sent))])
    assert len(findings) == 1 and findings[0].lost == []
    assert [(unit["kind"], unit["first"]) for unit in findings[0].torn] == [("group", "Git status:")]
    # Moved whole (the label with its content), nothing is torn.
    forwarded["messages"].pop(1)  # a system message left empty is dropped
    forwarded["messages"][-2]["content"] = "\n".join([*moved, "clean"])
    assert torn_units([(_exchange(0, forwarded), _exchange(0, sent))]) == []


def test_the_check_finds_an_emptied_wrapper_and_a_lost_line() -> None:
    """Continue's ``<context name="gitStatus">`` forwarded with its status lines moved elsewhere, and a
    line that arrives nowhere."""
    sent = load(RECORDED / "continue-cli-edits.json")["requests"][1]["body"]
    system = sent["messages"][0]["content"]
    lines = system.split("\n")
    opening = next(i for i, line in enumerate(lines) if line.startswith('<context name="gitStatus">'))
    closing = lines.index("</context>", opening)
    status = [line for line in lines[opening + 1 : closing] if line.strip()]
    forwarded = copy.deepcopy(sent)
    forwarded["messages"][0]["content"] = "\n".join(line for line in lines if line not in status)
    forwarded["messages"].insert(-1, {"role": "system", "content": "\n".join(status)})
    findings = torn_units([(_exchange(0, forwarded), _exchange(0, sent))])
    assert [unit["first"] for unit in findings[0].torn if unit["kind"] == "element"] == [lines[opening][:120]]
    forwarded["messages"].pop(-2)  # the status lines now arrive nowhere
    assert torn_units([(_exchange(0, forwarded), _exchange(0, sent))])[0].lost == status


def test_the_session_audit_takes_what_the_client_sent_before_and_nothing_else() -> None:
    """A repaired window re-sends messages of the client's earlier requests: foreign to the request
    they are added to, not to the session; a line no request sent is foreign to both."""
    first = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]}
    second = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    }
    repaired = {"messages": [*first["messages"], *second["messages"][1:]]}
    invented = {"messages": [*repaired["messages"][:-1], {"role": "user", "content": "q2\nnever sent"}]}
    pairs = [(_exchange(0, first), _exchange(0, first)), (_exchange(1, repaired), _exchange(1, second))]
    assert [f.backend_seq for f in audit(pairs)] == [1]
    assert audit(pairs, session=True) == []
    pairs[1] = (_exchange(1, invented), _exchange(1, second))
    assert [f.lines for f in audit(pairs, session=True)] == [["never sent"]]


@pytest.mark.parametrize("name", ["crewai-plain", "crewai-edits", "crewai-react-plain", "crewai-react-edits"])
def test_a_templated_task_finds_the_block_where_the_task_before_it_left_it(name: str) -> None:
    """Each CrewAI turn sends two one-shot requests with one system prompt, byte for byte: the task,
    then a summary task whose template opens the same way every turn. The moved block (working
    directory, time, git status) went before the first task's question and, the summary task read as
    templated (``after_templated_user``), after the second's: the second shared only the stable
    system text with the request just before it (+69 to +85 prefill on a turn). Before a templated
    question, a block that extends a prompt the app forwarded stays there."""
    recording, _, proxied = _session(name)
    for index in (3, 5, 7):  # the summary task of turns 2-4
        before, after = (r["body"]["messages"] for r in recording["requests"][index - 1 : index + 1])
        assert before[0] == after[0]  # the client: one system prompt for both tasks
        got_before, got_after = (r["body"]["messages"] for r in proxied.backend_requests[index - 1 : index + 1])
        shared = next(i for i, (a, b) in enumerate(zip(got_before, got_after, strict=False)) if a != b)
        roles = [m["role"] for m in got_before], [m["role"] for m in got_after]
        assert shared >= len(got_before) - 1, (index, roles)
