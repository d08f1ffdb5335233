"""A CrewAI crew (the real ``crewai`` from PyPI, its native OpenAI provider), one turn per process.

The crew is what a user of the framework writes: one ``Agent`` with a role, a goal and a backstory whose
``{placeholders}`` ``kickoff(inputs=...)`` fills from the machine at each start (working directory,
time, ``git status --short``), three tools (read a file, list the files, show the diff), memory off,
and two tasks in sequence (``Process.sequential``): the turn's question, then a one-line summary of its
answer (the first task's output is the second's context). CrewAI renders the role, goal and backstory
into the system message and the task, its expected output and the context into the user message.

It talks to an OpenAI-compatible server (``LLM(model="openai/<model>", base_url=...)``,
``/v1/chat/completions``). Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.crewai_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL and the model; a crew keeps no conversation between kickoffs. This
module imports only the standard library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "crewai==1.15.30 litellm==1.110.2"
STATE = "crewai-agent-state.json"


def build_crew(base_url: str, model: str) -> Any:
    from crewai import LLM, Agent, Crew, Process, Task
    from crewai.tools import tool

    @tool("read_file")
    def read_file(path: str) -> str:
        """Read a text file of the repository."""
        return agent_turn.read_file(path)

    @tool("list_files")
    def list_files() -> str:
        """List the files git tracks in the repository."""
        return agent_turn.git("ls-files")

    @tool("show_diff")
    def show_diff() -> str:
        """Show the uncommitted changes (git diff)."""
        return agent_turn.git("diff")

    # CREWAI_BENCH_LITELLM=1: through LiteLLM (``is_litellm``), which knows no function calling for a model
    # it has never heard of: CrewAI then renders the tools into the system prompt (ReAct text).
    litellm = os.environ.get("CREWAI_BENCH_LITELLM") == "1"
    llm = LLM(model=f"openai/{model}", base_url=base_url, api_key="sk-bench-dummy-key", temperature=0,
              is_litellm=litellm)  # fmt: skip
    agent = Agent(
        role="Senior software engineer",
        goal="Answer questions about the repository in {cwd} accurately and briefly.",
        backstory=(
            "You maintain a small Python repository and review it carefully.\n"
            "Working directory: {cwd}\nCurrent time: {now}\nGit status:\n{status}"
        ),
        tools=[read_file, list_files, show_diff],
        llm=llm,
        memory=False,
        allow_delegation=False,
        max_iter=3,
        verbose=False,
    )
    answer = Task(description="{question}", expected_output="One sentence.", agent=agent)
    summary = Task(
        description="Summarize the answer above in at most ten words.",
        expected_output="A line of at most ten words.",
        agent=agent,
        context=[answer],
    )
    return Crew(agents=[agent], tasks=[answer, summary], process=Process.sequential, memory=False, verbose=False)


def one_turn(state_path: Path, prompt: str) -> int:
    state = json.loads(state_path.read_text())
    crew = build_crew(state["base_url"], state["model"])
    inputs = {
        "cwd": str(Path.cwd()),
        "now": dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "status": agent_turn.git("status", "--short").rstrip("\n") or "clean",
        "question": prompt,
    }
    result = crew.kickoff(inputs=inputs)
    print(result.raw, flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("OTEL_SDK_DISABLED", "true")
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
