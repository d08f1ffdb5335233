"""An agno coding agent (the real ``agno`` from PyPI, with ``openai`` and ``sqlalchemy``), one turn per process.

The agent is what a user of the framework writes: a static instruction, three tools (read a file,
list the files, show the diff), agno's own ``add_datetime_to_context`` (agno writes
``<additional_information>`` with ``- The current time is ...``) and ``additional_context`` built at
each start from the machine (working directory, ``git status --short``); the conversation is kept by
agno itself in a SQLite database (``SqliteDb``, one ``session_id``, ``add_history_to_context``), as an
application keeping a chat across processes would.

It talks to an OpenAI-compatible server (``OpenAILike(base_url=...)``, ``/v1/chat/completions``). Each
turn is one process with the agent venv's interpreter::

    python -m bench.clients.agno_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL and the model; the database lies beside it. This module imports only
the standard library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "agno==3.1.10 openai==3.63.0 sqlalchemy==2.1.9 greenlet==3.5.6"
STATE = "agno-agent-state.json"
INSTRUCTIONS = [
    "You are a careful coding assistant working in a git repository.",
    "Use the tools to read files before changing them.",
]


def read_file(path: str) -> str:
    """Read a text file of the repository."""
    return agent_turn.read_file(path)


def list_files() -> str:
    """List the files git tracks in the repository."""
    return agent_turn.git("ls-files")


def show_diff() -> str:
    """Show the uncommitted changes (git diff)."""
    return agent_turn.git("diff")


def build_agent(state_path: Path, base_url: str, model: str) -> Any:
    from agno.agent import Agent
    from agno.db.sqlite import SqliteDb
    from agno.models.openai.like import OpenAILike

    status = agent_turn.git("status", "--short").rstrip("\n") or "clean"
    environment = f"Working directory: {Path.cwd()}\nGit status:\n{status}"
    return Agent(
        model=OpenAILike(id=model, base_url=base_url, api_key="sk-bench-dummy-key"),
        instructions=INSTRUCTIONS,
        tools=[read_file, list_files, show_diff],
        additional_context=environment,
        add_datetime_to_context=True,
        db=SqliteDb(db_file=str(state_path.with_suffix(".db"))),
        session_id="bench-session",
        add_history_to_context=True,
        num_history_runs=10,
        telemetry=False,
    )


def one_turn(state_path: Path, prompt: str) -> int:
    state = json.loads(state_path.read_text())
    agent = build_agent(state_path, state["base_url"], state["model"])
    result = agent.run(prompt)
    print(result.content, flush=True)
    return 1 if str(getattr(result, "status", "")).lower().endswith("error") else 0  # agno answers errors as content


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
