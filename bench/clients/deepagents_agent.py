"""A LangChain Deep Agent (the real ``deepagents`` and ``langchain-openai`` from PyPI), one turn per process.

The agent is what a user of the framework writes: ``create_deep_agent`` on a ``ChatOpenAI`` pointed at
the server (``base_url``, ``/v1/chat/completions``), deepagents' built-in tools (``ls``, ``read_file``,
``write_file``, ``edit_file``, ``glob``, ``grep``, ``execute``, ``task`` with its general-purpose
subagent) on a ``FilesystemBackend`` rooted at the repository (``virtual_mode``), the to-do list
(``TodoListMiddleware``: ``write_todos``, whose list is kept in the agent's state and re-sent with it),
and long-term memory (``memory=["/AGENTS.md"]``: ``MemoryMiddleware`` renders the file's text into an
``<agent_memory>`` element at the end of the system prompt). Our instructions come first, with an
environment section built at each start from the machine::

    You are a careful coding agent working in a small Python repository. ...

    ## Environment
    Working directory: <cwd>
    Current time: <YYYY-MM-DD HH:MM:SS>
    Git status:
    <git status --short, or "clean">

deepagents then appends its own sections (filesystem, subagents, to-dos, memory), each a text part of
the system message: ``ChatOpenAI`` sends the system message's ``content`` as a list of text parts.

``DEEPAGENTS_BENCH_MEMORY=1``: the agent's memory grows during the session, as the memory prompt tells
the agent to keep it (``edit_file`` on ``/AGENTS.md``): after each turn the driver appends what the user
asked to the repository's ``AGENTS.md`` (the fake's text replies make no tool call, so the driver makes
the edit the agent would), and the next turn's system prompt holds the longer ``<agent_memory>``.

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.deepagents_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model, the conversation so far (``messages_to_dict``) and the
to-do list: the turn invokes the graph with them and the new question and keeps what the graph returns,
as an application keeping a chat in its own store does (the memory is read again at each start, as
deepagents does for a thread without ``memory_contents``). This module imports only the standard
library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "deepagents==0.7.32 langchain-openai==1.8.1"
STATE = "deepagents-agent-state.json"
INSTRUCTIONS = (
    "You are a careful coding agent working in a small Python repository. Read files before changing "
    "them, keep a to-do list for work of several steps, and answer briefly."
)


def system_prompt() -> str:
    status = agent_turn.git("status", "--short").rstrip("\n") or "clean"
    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    environment = f"Working directory: {Path.cwd()}\nCurrent time: {now}\nGit status:\n{status}"
    return f"{INSTRUCTIONS}\n\n## Environment\n{environment}"


def build_agent(base_url: str, model: str) -> Any:
    from deepagents import create_deep_agent
    from deepagents.backends import FilesystemBackend
    from langchain.agents.middleware import TodoListMiddleware
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="sk-bench-dummy-key", temperature=0)
    return create_deep_agent(
        model=llm,
        system_prompt=system_prompt(),
        middleware=[TodoListMiddleware()],
        memory=["/AGENTS.md"],
        backend=FilesystemBackend(root_dir=Path.cwd(), virtual_mode=True),
    )


def remember(prompt: str) -> None:
    """The memory edit the agent is told to make (``edit_file`` on ``/AGENTS.md``)."""
    path = Path.cwd() / "AGENTS.md"
    text = path.read_text() if path.exists() else "# Agent memory\n"
    question = prompt.split("] ", 1)[-1].split("?")[0].split(".")[0]
    path.write_text(text + f"- The user asked: {question}.\n")


def one_turn(state_path: Path, prompt: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from langchain_core.messages import HumanMessage, messages_from_dict, messages_to_dict

    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    history = messages_from_dict(state["history"])
    inputs: dict[str, Any] = {"messages": [*history, HumanMessage(prompt)]}
    if state.get("todos"):
        inputs["todos"] = state["todos"]
    result = agent.invoke(inputs, {"recursion_limit": 50})
    state["history"] = messages_to_dict(result["messages"])
    state["todos"] = result.get("todos") or []
    state_path.write_text(json.dumps(state, indent=1))
    if os.environ.get("DEEPAGENTS_BENCH_MEMORY") == "1":
        remember(prompt)
    print(result["messages"][-1].content, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
