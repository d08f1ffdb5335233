"""A smolagents ``ToolCallingAgent`` (the real ``smolagents`` from PyPI), one turn per process.

The agent is what a smolagents application writes: ``ToolCallingAgent`` on an ``OpenAIServerModel``
pointed at the server (``api_base``, ``/v1/chat/completions``, smolagents' default ``tool_choice``
``"required"``), two ``@tool`` functions (read a file, list the files) plus smolagents' own
``final_answer``, and the system prompt exactly as the library builds it from its
``toolcalling_agent.yaml`` template (the tools rendered into it; nothing of ours in it). Each turn
is ``agent.run(prompt, reset=False)``: the agent's memory carries, so every request re-sends the
system prompt, the earlier tasks, the model's outputs and the tool observations (including the
"Error while parsing tool call" observations smolagents writes when the model answers in text).

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.smolagents_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL and the model; the agent's memory steps (``agent.memory.steps``,
smolagents' own dataclasses, their ``AgentError`` kept by class and message) are pickled next to it
(``STATE.steps.pkl``) and put back before the
run, as an application keeping one agent alive across a chat would have them. This module imports
only the standard library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "smolagents==1.26.0 openai"
STATE = "smolagents-agent-state.json"
MAX_STEPS = 2


def build_agent(base_url: str, model: str) -> Any:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def read_file(path: str) -> str:
        """Read a text file of the repository.

        Args:
            path: The file's path, relative to the repository root.
        """
        return agent_turn.read_file(path)

    @tool
    def list_files() -> str:
        """List the files git tracks in the repository, one a line."""
        return agent_turn.git("ls-files")

    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key="sk-bench-dummy-key", temperature=0)
    return ToolCallingAgent(tools=[read_file, list_files], model=llm, max_steps=MAX_STEPS, verbosity_level=0)


def _error(cls: type[Exception], message: str) -> Any:
    """An ``AgentError`` back from the pickle (its ``__init__`` wants a logger to log to)."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.message = message  # type: ignore[attr-defined]  # an AgentError, as __init__ sets it
    return error


def _picklable_errors() -> None:
    """smolagents keeps each step's ``AgentError`` in memory; pickle them by class and message."""
    import copyreg

    from smolagents.utils import AgentError

    pending = [AgentError]
    while pending:
        cls = pending.pop()
        copyreg.pickle(cls, lambda error: (_error, (type(error), error.message)))
        pending.extend(cls.__subclasses__())


def one_turn(state_path: Path, prompt: str) -> int:
    _picklable_errors()
    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    steps_path = state_path.with_name(state_path.name + ".steps.pkl")
    if steps_path.exists():
        agent.memory.steps = pickle.loads(steps_path.read_bytes())
    answer = agent.run(prompt, reset=False)
    steps_path.write_bytes(pickle.dumps(agent.memory.steps))
    print(answer, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
