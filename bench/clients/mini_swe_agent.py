"""mini-swe-agent (the real ``mini-swe-agent`` from PyPI, LiteLLM inside), one turn per process.

The agent is the one ``mini`` runs with its text-based configuration (``mini_textbased.yaml``, shipped in
the package): ``DefaultAgent`` on a ``LocalEnvironment`` and a ``LitellmTextbasedModel`` (LiteLLM's
``openai/`` provider at the base URL, ``/v1/chat/completions``, no tools declared). Its history is
linear: the system template, the instance template (the task, then the workflow, then
``<system_information>`` with the machine's ``uname``), then the model's outputs, each answered by a user
message (a bash command's observation ``<returncode>``/``<output>``, or the "Format error" text mini
writes when an output holds no ``mswea_bash_command`` block; three of those in a row end the task).

A later turn goes on with the same history, as ``mini``'s interactive agent does when the user types a
new task once the agent has finished: the user first runs ``git status --short`` in human mode (mini
appends ``User command:`` and the observation as user messages), then the new task arrives as
``The user added a new task: ...``.

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.mini_swe_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the agent's messages (mini's own dicts, ``extra``
included: LiteLLM is sent them without it). This module imports only the standard library at its top.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "mini-swe-agent==2.4.6"
STATE = "mini-swe-agent-state.json"
HUMAN_COMMAND = "git status --short"


def build_agent(base_url: str, model: str) -> Any:
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_path
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    config = yaml.safe_load(get_config_path("mini_textbased").read_text())
    # ``mode``: the interactive agent's; a step limit, as a text answer is a format error every time.
    agent_config = {**{k: v for k, v in config["agent"].items() if k != "mode"}, "step_limit": 6}
    model_config = {
        **config["model"],
        "model_name": f"openai/{model}",
        "cost_tracking": "ignore_errors",
        "model_kwargs": {**config["model"].get("model_kwargs", {}), "api_base": base_url,
                         "api_key": "sk-bench-dummy-key", "temperature": 0.0},
    }  # fmt: skip
    environment = LocalEnvironment(**config.get("environment", {}), cwd=str(Path.cwd()))
    return DefaultAgent(LitellmTextbasedModel(**model_config), environment, **agent_config)


def _loop(agent: Any) -> dict[str, Any]:
    """``DefaultAgent.run`` after its reset: step until an exit message."""
    from minisweagent.exceptions import FormatError, InterruptAgentFlow

    while True:
        try:
            agent.step()
            agent.n_consecutive_format_errors = 0
        except FormatError as e:
            agent.n_consecutive_format_errors += 1
            if 0 < agent.config.max_consecutive_format_errors <= agent.n_consecutive_format_errors:
                status = {"exit_status": "RepeatedFormatError", "submission": ""}
                agent.add_messages(*e.messages, {"role": "exit", "content": "RepeatedFormatError", "extra": status})
            else:
                agent.add_messages(*e.messages)
        except InterruptAgentFlow as e:
            agent.add_messages(*e.messages)
        if agent.messages[-1].get("role") == "exit":
            return agent.messages[-1].get("extra", {})


def one_turn(state_path: Path, prompt: str) -> int:
    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    if not state["history"]:
        outcome = agent.run(prompt)
    else:
        agent.extra_template_vars |= {"task": prompt}
        agent.messages = [m for m in state["history"] if m.get("role") != "exit"]
        output = agent.env.execute({"command": HUMAN_COMMAND})
        agent.add_messages({"role": "user", "content": f"User command: \n```bash\n{HUMAN_COMMAND}\n```"})
        agent.add_messages(*agent.model.format_observation_messages({}, [output], agent.get_template_vars()))
        agent.add_messages({"role": "user", "content": f"The user added a new task: {prompt}",
                            "extra": {"interrupt_type": "UserNewTask"}})  # fmt: skip
        outcome = _loop(agent)
    state["history"] = json.loads(json.dumps(agent.messages, default=str))
    state_path.write_text(json.dumps(state, indent=1))
    print(outcome.get("exit_status", ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
