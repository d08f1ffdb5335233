"""An OpenAI Agents SDK coding agent (the real ``openai-agents`` from PyPI), one turn per process.

The agent is what a user of the SDK writes for a self-hosted model: an ``Agent`` on
``OpenAIResponsesModel`` (``/v1/responses``) with an ``AsyncOpenAI`` client pointed at the server,
tracing off, ``store`` false (nothing kept server side: the history travels in every request), four
function tools and instructions built by a function on every run, the stable rules first and the
machine's state after them (the SDK calls a function given as ``instructions`` with the run context
and the agent on every run)::

    You are a coding agent working in a git repository. ...

    ## Environment
    - Working directory: <cwd>
    - Current time: <ISO 8601, to the second>
    - Git status:
    ```
    <git status --short, or "clean">
    ```

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.openai_agents turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the conversation so far as the SDK hands it back
(``RunResult.to_input_list()``): the turn runs the agent on that list plus the new user message and
keeps the result's list, as an application keeping a chat without server-side state does. This
module imports only the standard library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "openai-agents==0.24.0"
STATE = "openai-agents-state.json"
RULES = (
    "You are a coding agent working in a git repository. Inspect files with the tools before you answer "
    "questions about them, and never claim a change you did not make.\n"
    "Keep answers short: one or two sentences unless the user asks for more."
)


def instructions(context: Any, agent: Any) -> str:
    """The agent's instructions, built on every run (the SDK calls it with the run context and the agent)."""
    status = agent_turn.git("status", "--short").rstrip("\n") or "clean"
    now = dt.datetime.now().replace(microsecond=0).isoformat()
    return (
        f"{RULES}\n\n"
        "## Environment\n"
        f"- Working directory: {Path.cwd()}\n"
        f"- Current time: {now}\n"
        "- Git status:\n"
        f"```\n{status}\n```"
    )


def build_agent(base_url: str, model: str) -> Any:
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="sk-bench-dummy-key")

    @function_tool
    def read_file(path: str) -> str:
        """Read a text file of the repository.

        Args:
            path: The file's path, relative to the repository root.
        """
        return agent_turn.read_file(path)

    @function_tool
    def list_files() -> list[str]:
        """List the files git tracks in the repository."""
        return agent_turn.git("ls-files").split()

    @function_tool
    def show_diff(path: str | None = None) -> str:
        """Show the uncommitted changes (git diff), of one file or of all.

        Args:
            path: Only this file's changes, when given.
        """
        return agent_turn.git("diff", *([path] if path else []))

    @function_tool
    def grep(pattern: str) -> str:
        """Search the tracked files for a regular expression (git grep -n).

        Args:
            pattern: The regular expression.
        """
        return agent_turn.git("grep", "-n", "-E", pattern)

    return Agent(
        name="repo-assistant",
        instructions=instructions,
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(store=False),
        tools=[read_file, list_files, show_diff, grep],
    )


def one_turn(state_path: Path, prompt: str) -> int:
    from agents import Runner

    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    result = Runner.run_sync(agent, [*state["history"], {"role": "user", "content": prompt}])
    state["history"] = result.to_input_list()
    state_path.write_text(json.dumps(state, indent=1))
    print(result.final_output, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
