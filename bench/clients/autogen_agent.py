"""An AutoGen AgentChat agent (the real ``autogen-agentchat`` and ``autogen-ext[openai]`` from PyPI), one turn
per process.

The agent is what a user of the framework writes: an ``AssistantAgent`` on an ``OpenAIChatCompletionClient``
at the base URL (``/v1/chat/completions``, a ``model_info`` for a model OpenAI does not know), three tools
(read a file, list the files, show the diff) and a system message built at each start from the machine::

    You are a careful coding assistant. Use the tools to read files before changing them.
    Working directory: <cwd>
    Current time: <YYYY-MM-DD HH:MM:SS>
    Git status:
    <git status --short, or "clean">

Its model context is a ``BufferedChatCompletionContext(buffer_size=BUFFER)``: the whole conversation is
kept (and saved), but each request sends the system message and only the last ``BUFFER`` messages, a
sliding window; AutoGen sends no header naming the conversation. Each turn is one process with the agent
venv's interpreter::

    python -m bench.clients.autogen_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the agent's state (``AssistantAgent.save_state()``, its
``llm_context`` messages), loaded back before the turn. This module imports only the standard library at
its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "autogen-agentchat==0.7.5 autogen-ext[openai]==0.7.5"
STATE = "autogen-agent-state.json"
BUFFER = 4
INSTRUCTIONS = "You are a careful coding assistant. Use the tools to read files before changing them."


def read_file(path: str) -> str:
    """Read a text file of the repository."""
    return agent_turn.read_file(path)


def list_files() -> str:
    """List the files git tracks in the repository."""
    return agent_turn.git("ls-files")


def show_diff() -> str:
    """Show the uncommitted changes (git diff)."""
    return agent_turn.git("diff")


def build_agent(base_url: str, model: str) -> Any:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.model_context import BufferedChatCompletionContext
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model=model,
        base_url=base_url,
        api_key="sk-bench-dummy-key",
        model_info={"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                    "structured_output": False},
    )  # fmt: skip
    status = agent_turn.git("status", "--short").rstrip("\n") or "clean"
    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    system = f"{INSTRUCTIONS}\nWorking directory: {Path.cwd()}\nCurrent time: {now}\nGit status:\n{status}"
    return AssistantAgent(
        "assistant",
        model_client=client,
        tools=[read_file, list_files, show_diff],
        system_message=system,
        model_context=BufferedChatCompletionContext(buffer_size=BUFFER),
        reflect_on_tool_use=True,
    )


async def _turn(state: dict[str, Any], prompt: str) -> str:
    agent = build_agent(state["base_url"], state["model"])
    if state["history"]:
        await agent.load_state(state["history"])
    result = await agent.run(task=prompt)
    state["history"] = json.loads(json.dumps(await agent.save_state(), default=str))
    return str(result.messages[-1].content)


def one_turn(state_path: Path, prompt: str) -> int:
    state = json.loads(state_path.read_text())
    answer = asyncio.run(_turn(state, prompt))
    state_path.write_text(json.dumps(state, indent=1))
    print(answer, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
