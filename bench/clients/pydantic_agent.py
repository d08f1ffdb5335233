"""A pydantic-ai coding agent (the real ``pydantic-ai-slim[openai]`` from PyPI), one turn per process.

The agent is what a user of the framework writes: a static instruction, three tools (read a file,
list the files, show the diff) and dynamic instructions built on every run from the machine, the
shape issue 44 measured::

    Working directory: <cwd>
    Current time: <YYYY-MM-DD HH:MM:SS>
    Git status:
    <git status --short, or "clean">

It talks to an OpenAI-compatible server (``OpenAIChatModel`` with ``OpenAIProvider(base_url=...)``,
``/v1/chat/completions``). Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.pydantic_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the conversation so far as pydantic-ai dumps it
(``ModelMessagesTypeAdapter``): the turn runs the agent with that history and appends the run's new
messages, as an application keeping a chat would. This module imports only the standard library at
its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "pydantic-ai-slim[openai]==2.68.0"
STATE = "pydantic-agent-state.json"
INSTRUCTIONS = "You are a careful coding assistant. Use the tools to read files before changing them."


def build_agent(base_url: str, model: str) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key="sk-bench-dummy-key")
    agent = Agent(OpenAIChatModel(model, provider=provider), instructions=INSTRUCTIONS)

    @agent.instructions
    def environment() -> str:
        status = agent_turn.git("status", "--short").rstrip("\n") or "clean"
        now = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        return f"Working directory: {Path.cwd()}\nCurrent time: {now}\nGit status:\n{status}"

    @agent.tool_plain
    def read_file(path: str) -> str:
        """Read a text file of the repository."""
        return (Path.cwd() / path).read_text()

    @agent.tool_plain
    def list_files() -> list[str]:
        """List the files git tracks in the repository."""
        return agent_turn.git("ls-files").split()

    @agent.tool_plain
    def show_diff() -> str:
        """Show the uncommitted changes (git diff)."""
        return agent_turn.git("diff")

    return agent


def one_turn(state_path: Path, prompt: str) -> int:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    history = ModelMessagesTypeAdapter.validate_python(state["history"])
    result = agent.run_sync(prompt, message_history=history)
    state["history"] = ModelMessagesTypeAdapter.dump_python(result.all_messages(), mode="json")
    state_path.write_text(json.dumps(state, indent=1))
    print(result.output, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
