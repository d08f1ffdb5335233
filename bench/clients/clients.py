"""The clients: how each is installed, pointed at a base URL, and run headless for one turn.

Every run gets a fresh ``HOME`` (and XDG directories under it) and a fresh git repository, so no
session, config or cache leaks between runs. ``base_url`` is the server root (``http://host:port``);
clients that want the OpenAI API root get ``base_url + "/v1"``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from bench.clients import (
    agent_turn,
    agno_agent,
    autogen_agent,
    crewai_agent,
    deepagents_agent,
    dify,
    install,
    langgraph_agent,
    llamaindex_agent,
    mini_swe_agent,
    openai_agents,
    openwebui,
    pydantic_agent,
    smolagents_agent,
)

DUMMY_KEY = "sk-bench-dummy-key"


@dataclass
class Workspace:
    """One run's directories and endpoint."""

    home: Path
    repo: Path
    base_url: str
    model: str
    state: dict[str, str] = field(default_factory=dict)

    @property
    def openai_base(self) -> str:
        return self.base_url + "/v1"


class Client:
    name = ""
    protocol = ""  # the route the client speaks: chat, messages, responses
    coding_agent = True
    session_header = ""  # the header it sends that names its session, when it sends one

    def install(self) -> Path:
        raise NotImplementedError

    def prepare(self, ws: Workspace) -> dict[str, str]:
        """Write the client's config under ``ws.home``; returns its environment variables."""
        raise NotImplementedError

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        """The command line of turn ``index`` (0-based): the first starts the session, later ones continue it."""
        raise NotImplementedError

    def serve(
        self, binary: Path, ws: Workspace, env: dict[str, str], log: Path
    ) -> contextlib.AbstractContextManager[object]:
        """A server the client needs for the whole run (after ``prepare``, until the last turn): none by default."""
        return contextlib.nullcontext()


class ClaudeCode(Client):
    name = "claude-code"
    protocol = "messages"
    session_header = "x-claude-code-session-id"

    def install(self) -> Path:
        return install.npm_package(self.name, "@anthropic-ai/claude-code@2.1.197", "claude")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        ws.state["session"] = str(uuid.uuid4())
        model = ws.model
        return {
            "ANTHROPIC_BASE_URL": ws.base_url,
            "ANTHROPIC_API_KEY": DUMMY_KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
        }

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        session = ["--session-id", ws.state["session"]] if index == 0 else ["--resume", ws.state["session"]]
        return [str(binary), "-p", prompt, *session, "--model", ws.model, "--output-format", "json"]


class Codex(Client):
    name = "codex"
    protocol = "responses"
    session_header = "session_id"
    wire_api = "responses"

    def install(self) -> Path:
        return install.npm_package(self.name, "@openai/codex@0.171.0", "codex")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        codex_home = ws.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{ws.model}"\n'
            'model_provider = "bench"\n'
            "check_for_update_on_startup = false\n"
            "[model_providers.bench]\n"
            'name = "bench"\n'
            f'base_url = "{ws.openai_base}"\n'
            'env_key = "BENCH_API_KEY"\n'
            f'wire_api = "{self.wire_api}"\n'
            "[analytics]\nenabled = false\n"
            '[otel]\nexporter = "none"\n'
        )
        return {"CODEX_HOME": str(codex_home), "BENCH_API_KEY": DUMMY_KEY}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        if index == 0:
            return [str(binary), "exec", "--json", "--sandbox", "read-only", prompt]
        return [str(binary), "exec", "resume", "--last", "--json", prompt]


class OpenCode(Client):
    name = "opencode"
    protocol = "chat"
    session_header = "x-session-id"
    # What differs between opencode and its forks (Kilo Code): the package, its command, its config
    # file (under ~/.config) and schema, and the prefix of its environment switches.
    package, command = "opencode-ai@1.18.33", "opencode"
    config_file, schema = "opencode/opencode.json", "https://opencode.ai/config.json"
    environment_prefix = "OPENCODE"

    def install(self) -> Path:
        return install.npm_package(self.name, self.package, self.command)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        path = ws.home / ".config" / self.config_file
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "$schema": self.schema,
            "provider": {
                "bench": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "bench",
                    "options": {"baseURL": ws.openai_base, "apiKey": DUMMY_KEY},
                    "models": {ws.model: {"name": ws.model}},
                }
            },
            "model": f"bench/{ws.model}",
            "small_model": f"bench/{ws.model}",
            "autoupdate": False,
            "share": "disabled",
        }
        path.write_text(json.dumps(config, indent=2))
        switches = ("AUTOUPDATE", "MODELS_FETCH", "LSP_DOWNLOAD", "DEFAULT_PLUGINS")
        return {f"{self.environment_prefix}_DISABLE_{switch}": "1" for switch in switches}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = [] if index == 0 else ["--continue"]
        return [str(binary), "run", "-m", f"bench/{ws.model}", *more, prompt]


class QwenCode(Client):
    name = "qwen-code"
    protocol = "chat"

    def install(self) -> Path:
        return install.npm_package(self.name, "@qwen-code/qwen-code@0.15.10", "qwen")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        settings_dir = ws.home / ".qwen"
        settings_dir.mkdir(parents=True, exist_ok=True)
        settings = {
            "security": {"auth": {"selectedType": "openai"}},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "model": {"name": ws.model},
        }
        (settings_dir / "settings.json").write_text(json.dumps(settings, indent=2))
        return {"OPENAI_BASE_URL": ws.openai_base, "OPENAI_API_KEY": DUMMY_KEY, "OPENAI_MODEL": ws.model}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = [] if index == 0 else ["--continue"]
        return [str(binary), "--auth-type", "openai", "-m", ws.model, "-o", "json", *more, prompt]


class Aider(Client):
    name = "aider"
    protocol = "chat"

    def install(self) -> Path:
        return install.pip_package(self.name, "aider-chat==0.86.2", "aider", timeout=1200.0)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS": "false"}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        return [
            str(binary),
            "--model", f"openai/{ws.model}",
            "--openai-api-base", ws.openai_base,
            "--openai-api-key", DUMMY_KEY,
            "--message", prompt,
            "--yes-always",
            "--restore-chat-history",
            "--no-auto-commits",
            "--no-check-update",
            "--no-show-model-warnings",
            "--analytics-disable",
            "--no-gitignore",
            "--no-pretty",
            "--no-fancy-input",
            "--no-detect-urls",
        ]  # fmt: skip


class OpenWebUI(Client):
    """The real Open WebUI server, driven over its HTTP and socket.io API as its web front end (see openwebui.py):
    each turn is one message in each of ``openwebui.CHATS`` chats."""

    name = "open-webui"
    protocol = "chat"
    coding_agent = False
    session_header = "x-openwebui-chat-id"

    def install(self) -> Path:
        return openwebui.install_open_webui()

    def prepare(self, ws: Workspace) -> dict[str, str]:
        from testbed.serving import free_port

        return openwebui.environment(ws.home, ws.openai_base, free_port())

    def serve(
        self, binary: Path, ws: Workspace, env: dict[str, str], log: Path
    ) -> contextlib.AbstractContextManager[object]:
        return openwebui.serve(binary, ws.home, ws.model, env, log)

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        python = binary.with_name("python")  # the server's venv: it has python-socketio
        return [
            str(python),
            "-m",
            "bench.clients.openwebui",
            "turn",
            str(ws.home / openwebui.STATE),
            str(index),
            prompt,
        ]


class DifyPlugin(Client):
    """A Dify chatbot with a knowledge base, sent by Dify's OpenAI-compatible model plugin (the real
    ``dify_plugin`` SDK; see dify.py): each turn is one message in each of ``dify.CONVERSATIONS``."""

    name = "dify-plugin"
    protocol = "chat"
    coding_agent = False

    def install(self) -> Path:
        # The SDK has no command: a wrapper that answers --version, as the bench prints each client's.
        python = install.pip_package(self.name, dify.PACKAGE, "python", timeout=900.0)
        wrapper = python.with_name("dify-plugin-bench")
        if not wrapper.exists():
            wrapper.write_text(
                "#!/bin/sh\n"
                'exec "$(dirname "$0")/python" -c "import importlib.metadata as m; '
                "print('dify_plugin', m.version('dify_plugin'))\"\n"
            )
            wrapper.chmod(0o755)
        return wrapper

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {"PYTHONPATH": str(openwebui.REPO_ROOT)}  # the turn driver: python -m bench.clients.dify

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        state = ws.home / dify.STATE
        dify.write_turn(state, ws.base_url, ws.model, index, prompt)
        return [str(binary.with_name("python")), "-m", "bench.clients.dify", "turn", str(state), str(index)]


class ContinueCLI(Client):
    """Continue's CLI (``cn -p``, headless) on a local ``config.yaml`` naming an OpenAI-compatible model."""

    name = "continue-cli"
    protocol = "chat"

    def install(self) -> Path:
        return install.npm_package(self.name, "@continuedev/cli@1.5.47", "cn")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        config_dir = ws.home / ".continue"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "config.yaml").write_text(
            "name: bench\n"
            "version: 0.0.1\n"
            "schema: v1\n"
            "models:\n"
            f"  - name: {ws.model}\n"
            "    provider: openai\n"
            f"    model: {ws.model}\n"
            f"    apiBase: {ws.openai_base}\n"
            f"    apiKey: {DUMMY_KEY}\n"
            "    roles: [chat, edit, apply]\n"
        )
        ws.state["config"] = str(config_dir / "config.yaml")
        return {
            "CONTINUE_GLOBAL_DIR": str(config_dir),
            "CONTINUE_CLI_ENABLE_TELEMETRY": "0",
            "CONTINUE_METRICS_ENABLED": "0",
        }

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = [] if index == 0 else ["--resume"]
        return [str(binary), "--config", ws.state["config"], "-p", *more, prompt]


class KiloCode(OpenCode):
    """Kilo Code's CLI (``kilo run``, an OpenCode fork) on a ``kilo.json`` naming an OpenAI-compatible
    provider. 7.7.7: 7.8.1 on npm lacks its platform packages (``@kilocode/cli-linux-x64@7.8.1``)."""

    name = "kilo-code"
    package, command = "@kilocode/cli@7.7.7", "kilo"
    config_file, schema = "kilo/kilo.json", "https://app.kilo.ai/config.json"
    environment_prefix = "KILO"


class ClineCLI(Client):
    """Cline's CLI (``cline --json``, headless, tools auto-approved by default) with its ``openai-compatible``
    provider written where ``cline auth --provider openai --baseurl ...`` writes it. Each turn is a new
    task: 3.0.65 has no headless resume (``--id`` switches to the TTY-only interactive mode and drops the
    prompt). Not ``--yolo``: that mode asks for a completion tool call and re-asks after a text answer."""

    name = "cline"
    protocol = "chat"

    def install(self) -> Path:
        return install.npm_package(self.name, "cline@3.0.65", "cline")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        settings_dir = ws.home / ".cline" / "data" / "settings"
        settings_dir.mkdir(parents=True, exist_ok=True)
        settings = {
            "provider": "openai-compatible",
            "apiKey": DUMMY_KEY,
            "model": ws.model,
            "baseUrl": ws.openai_base,
        }
        providers = {
            "version": 1,
            "lastUsedProvider": "openai-compatible",
            "modes": {},
            # Without ``updatedAt`` the CLI ignores the entry (and rewrites the file without the URL and key).
            "providers": {
                "openai-compatible": {
                    "settings": settings,
                    "updatedAt": "2026-12-01T09:00:00.000Z",
                    "tokenSource": "manual",
                }
            },
        }
        (settings_dir / "providers.json").write_text(json.dumps(providers, indent=2))
        return {}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        return [str(binary), "--json", "-P", "openai-compatible", "-m", ws.model, prompt]


class MistralVibe(Client):
    """Mistral's Vibe CLI (``vibe -p``, programmatic mode) on a ``~/.vibe/config.toml`` with a generic
    OpenAI-style provider at the base URL; later turns ``-c`` (the most recent session). 3.0.2: 3.0.3
    pins ``certifi==2026.10.19``, which the index does not have."""

    name = "mistral-vibe"
    protocol = "chat"

    def install(self) -> Path:
        return install.pip_package(self.name, "mistral-vibe==3.0.2", "vibe", timeout=900.0)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        vibe_home = ws.home / ".vibe"
        vibe_home.mkdir(parents=True, exist_ok=True)
        (vibe_home / "config.toml").write_text(
            f'active_model = "{ws.model}"\n'
            "enable_telemetry = false\n"
            "enable_update_checks = false\n"
            "enable_auto_update = false\n"
            "enable_notifications = false\n"
            "\n[[providers]]\n"
            'name = "bench"\n'
            f'api_base = "{ws.openai_base}"\n'
            'api_key_env_var = "BENCH_API_KEY"\n'
            'api_style = "openai"\n'
            'backend = "generic"\n'
            "\n[[models]]\n"
            f'name = "{ws.model}"\n'
            'provider = "bench"\n'
            f'alias = "{ws.model}"\n'
        )
        return {"VIBE_HOME": str(vibe_home), "BENCH_API_KEY": DUMMY_KEY}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = [] if index == 0 else ["-c"]
        return [str(binary), *more, "-p", prompt, "--output", "text"]


class OpenInterpreter(Client):
    """Open Interpreter's CLI in stdin mode (``interpreter -s``: one message from stdin, answered, exit),
    LiteLLM's ``openai/`` provider at the base URL. Each turn is a new conversation: the CLI resumes a
    saved one only interactively (``--conversations``)."""

    name = "open-interpreter"
    protocol = "chat"

    def install(self) -> Path:
        python = install.find_python(("3.11",))  # the one it was tried with
        return install.pip_package(self.name, "open-interpreter==0.4.3", "interpreter", python=python, timeout=1200.0)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        command = [
            str(binary), "-s", "-y", "-pl", "--disable_telemetry", "--offline",
            "--model", f"openai/{ws.model}", "--api_base", ws.openai_base, "--api_key", DUMMY_KEY,
            "--context_window", "32768", "--max_tokens", "1024",
        ]  # fmt: skip
        # The prompt on stdin (the bench gives the client none): sh pipes it in.
        return ["sh", "-c", 'printf "%s\\n" "$0" | "$@"', prompt, *command]


class PiCodingAgent(Client):
    """pi (``@mariozechner/pi-coding-agent``, ``pi -p``, print mode) on a ``~/.pi/agent/models.json``
    naming an ``openai-completions`` provider at the base URL (``supportsDeveloperRole`` false, as its
    docs say for vLLM); later turns ``-c`` (the most recent session). Its system prompt ends with
    ``Current date:`` and ``Current working directory:``."""

    name = "pi"
    protocol = "chat"

    def install(self) -> Path:
        return install.npm_package(self.name, "@mariozechner/pi-coding-agent@0.73.1", "pi")

    def prepare(self, ws: Workspace) -> dict[str, str]:
        agent_dir = ws.home / ".pi" / "agent"
        agent_dir.mkdir(parents=True, exist_ok=True)
        models = {
            "providers": {
                "bench": {
                    "baseUrl": ws.openai_base,
                    "api": "openai-completions",
                    "apiKey": DUMMY_KEY,
                    "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                    "models": [{"id": ws.model, "name": ws.model, "reasoning": False}],
                }
            }
        }
        (agent_dir / "models.json").write_text(json.dumps(models, indent=2))
        return {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1"}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = [] if index == 0 else ["-c"]
        return [str(binary), "--offline", "--provider", "bench", "--model", ws.model, *more, "-p", prompt]


class Gptme(Client):
    """gptme (``gptme -n``, non-interactive) on its ``local`` provider (``OPENAI_BASE_URL``); every turn
    names the same conversation (``--name``: the first starts it, later ones resume it). Its system
    messages hold the working directory, the date, the project's tree and ``## Git Status``."""

    name = "gptme"
    protocol = "chat"

    def install(self) -> Path:
        return install.pip_package(self.name, "gptme==0.35.1", "gptme", timeout=1200.0)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {
            "OPENAI_BASE_URL": ws.openai_base,
            "OPENAI_API_KEY": DUMMY_KEY,
            "GPTME_TELEMETRY_ENABLED": "false",
            # tiktoken's encodings are downloaded (unreachable here): the approximation gptme falls back
            # to, without the 5-second try each time it counts.
            "GPTME_TIKTOKEN_TIMEOUT": "0",
        }

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        return [str(binary), "-n", "--name", "bench-session", "-m", f"local/{ws.model}", "--no-stream", prompt]


class PythonAgent(Client):
    """An agent framework from PyPI driven by a small script of ours (``python -m <driver> turn STATE PROMPT``,
    one process per turn, with the framework venv's interpreter), the conversation kept in ``STATE``."""

    driver: ModuleType  # the driver module: PACKAGE, STATE
    distribution = ""  # the PyPI distribution whose version the bench prints

    def install(self) -> Path:
        python = install.pip_package(self.name, self.driver.PACKAGE, "python", timeout=900.0)
        wrapper = python.with_name(f"{self.name}-bench")
        if not wrapper.exists():  # answers --version, as the bench prints each client's
            wrapper.write_text(
                "#!/bin/sh\n"
                'exec "$(dirname "$0")/python" -c "import importlib.metadata as m; '
                f"print('{self.distribution}', m.version('{self.distribution}'))\"\n"
            )
            wrapper.chmod(0o755)
        return wrapper

    def prepare(self, ws: Workspace) -> dict[str, str]:
        agent_turn.write_state(ws.home / self.driver.STATE, ws.openai_base, ws.model)
        return {"PYTHONPATH": str(openwebui.REPO_ROOT)}  # the turn driver: python -m bench.clients.<driver>

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        state = str(ws.home / self.driver.STATE)
        module = self.driver.__name__
        return [str(binary.with_name("python")), "-m", module, "turn", state, prompt]


class PydanticAIAgent(PythonAgent):
    """A pydantic-ai agent with tools and dynamic instructions (working directory, time, git status;
    see pydantic_agent.py), the real ``pydantic-ai-slim`` from PyPI; one process per turn."""

    name = "pydantic-ai"
    protocol = "chat"
    driver = pydantic_agent
    distribution = "pydantic-ai-slim"


class OpenAIAgentsSDK(PythonAgent):
    """An OpenAI Agents SDK agent on ``/v1/responses`` (``store`` false, the history re-sent from
    ``to_input_list()``) with four function tools and instructions built per run (rules, then working
    directory, time and git status; see openai_agents.py), the real ``openai-agents`` from PyPI."""

    name = "openai-agents"
    protocol = "responses"
    driver = openai_agents
    distribution = "openai-agents"


class LangGraphAgent(PythonAgent):
    """A LangGraph ReAct agent (``create_react_agent``, ``ChatOpenAI`` at the base URL) whose system
    prompt a ``ChatPromptTemplate`` builds per model call from the date and time and the documents a
    retriever found for the question (see langgraph_agent.py), the real ``langgraph`` and
    ``langchain-openai`` from PyPI."""

    name = "langgraph"
    protocol = "chat"
    driver = langgraph_agent
    distribution = "langgraph"


class SmolagentsAgent(PythonAgent):
    """A smolagents ``ToolCallingAgent`` on an ``OpenAIServerModel`` at the base URL, two tools, the
    system prompt smolagents builds, memory carried across turns (``run(..., reset=False)``; see
    smolagents_agent.py), the real ``smolagents`` from PyPI."""

    name = "smolagents"
    protocol = "chat"
    driver = smolagents_agent
    distribution = "smolagents"


class LlamaIndexChat(PythonAgent):
    """A LlamaIndex ``ContextChatEngine`` on ``OpenAILike`` at the base URL whose system prompt holds the
    date and the documents a retriever found for the question (see llamaindex_agent.py), the real
    ``llama-index-core`` and ``llama-index-llms-openai-like`` from PyPI."""

    name = "llamaindex"
    protocol = "chat"
    driver = llamaindex_agent
    distribution = "llama-index-core"


class AgnoAgent(PythonAgent):
    """An agno ``Agent`` on ``OpenAILike`` at the base URL with three tools, ``add_datetime_to_context``,
    ``additional_context`` (working directory, git status) and its history kept in agno's ``SqliteDb``
    across processes (see agno_agent.py), the real ``agno`` from PyPI."""

    name = "agno"
    protocol = "chat"
    driver = agno_agent
    distribution = "agno"


class MiniSweAgent(PythonAgent):
    """mini-swe-agent's ``DefaultAgent`` with the text-based configuration ``mini`` ships
    (``mini_textbased.yaml``: bash commands in ``mswea_bash_command`` blocks, observations and format errors
    as user messages, ``<system_information>`` with the machine's ``uname`` in the first user message),
    LiteLLM's ``openai/`` provider at the base URL; later turns go on with the same linear history, a
    ``git status --short`` run by the user in human mode, then the new task (see mini_swe_agent.py)."""

    name = "mini-swe-agent"
    protocol = "chat"
    driver = mini_swe_agent
    distribution = "mini-swe-agent"

    def prepare(self, ws: Workspace) -> dict[str, str]:
        env = super().prepare(ws)
        # LiteLLM's cost map is downloaded (unreachable here); mini's first-run prompt and banner off.
        return {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_CONFIGURED": "true",
                "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors"}  # fmt: skip


class AutoGenAgent(PythonAgent):
    """An AutoGen AgentChat ``AssistantAgent`` on ``OpenAIChatCompletionClient`` at the base URL with three
    tools, a system message built at each start (working directory, time, git status) and a
    ``BufferedChatCompletionContext`` (the last ``BUFFER`` messages a request: a sliding window, no
    session header; see autogen_agent.py), the real ``autogen-agentchat`` and ``autogen-ext`` from PyPI."""

    name = "autogen"
    protocol = "chat"
    driver = autogen_agent
    distribution = "autogen-agentchat"


class CrewAIAgent(PythonAgent):
    """A CrewAI crew: one ``Agent`` (role, goal, a backstory whose placeholders hold the working directory,
    time and git status) with three tools, memory off, two tasks in sequence each turn (the question, then
    a summary with its answer as context; see crewai_agent.py), the real ``crewai`` from PyPI on its
    native OpenAI provider at the base URL."""

    name = "crewai"
    protocol = "chat"
    driver = crewai_agent
    distribution = "crewai"

    def prepare(self, ws: Workspace) -> dict[str, str]:
        env = super().prepare(ws)
        return {**env, "CREWAI_DISABLE_TELEMETRY": "true", "CREWAI_DISABLE_TRACKING": "true",
                "CREWAI_TRACING_ENABLED": "false", "OTEL_SDK_DISABLED": "true"}  # fmt: skip


class CrewAIReActAgent(CrewAIAgent):
    """The same crew through LiteLLM (``LLM(..., is_litellm=True)``), which knows no function calling for
    the model: CrewAI renders the tools into the system prompt and parses ReAct text (``Thought:``,
    ``Action:``, ``Final Answer:``)."""

    name = "crewai-react"

    def install(self) -> Path:  # the same venv as crewai's
        return CrewAIAgent().install()

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {**super().prepare(ws), "CREWAI_BENCH_LITELLM": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


class DeepAgent(PythonAgent):
    """A LangChain Deep Agent (``create_deep_agent`` on ``ChatOpenAI`` at the base URL): deepagents' built-in
    file tools on a ``FilesystemBackend`` rooted at the repository, ``task`` and its subagent, the to-do list
    (``write_todos``), long-term memory from ``/AGENTS.md`` rendered at the end of the system prompt, and our
    instructions first with an environment section (working directory, time, git status); the system message
    goes out as a list of text parts (see deepagents_agent.py), the real ``deepagents`` from PyPI."""

    name = "deepagents"
    protocol = "chat"
    driver = deepagents_agent
    distribution = "deepagents"


class DeepAgentMemory(DeepAgent):
    """The same agent whose memory grows each turn (``AGENTS.md`` gains a line after every turn, the edit its
    memory prompt asks for): the ``<agent_memory>`` element (the last text part of the system message, before
    deepagents' memory guidelines) changes every request from the second on."""

    name = "deepagents-memory"

    def install(self) -> Path:  # the same venv as deepagents'
        return DeepAgent().install()

    def prepare(self, ws: Workspace) -> dict[str, str]:
        return {**super().prepare(ws), "DEEPAGENTS_BENCH_MEMORY": "1"}


class LettaCode(Client):
    """Letta Code (PyPI ``letta``: the ``letta`` command with its bundled Node.js runtime) in local mode
    (``~/.letta/settings.json`` ``preferredBackendMode: local``, agents and conversations stored on this
    machine) with an ``openai-compatible`` provider at the base URL, written where ``letta backend local``
    and ``letta connect openai-compatible --base-url ...`` write them. ``letta -p --new-agent`` starts the
    agent and its first conversation (``local-conv-1`` in a fresh HOME); later turns ``--conversation
    local-conv-1``. Its ~29k-character system prompt ends with the agent's memory blocks (``<human>``,
    ``<persona>``, ``<memory>``: the files of its memory repository) and the skills list; the first user
    message holds ``<system-reminder>`` blocks (local time, working directory, git status, agent ids)."""

    name = "letta"
    protocol = "chat"
    memory_edits = False

    def install(self) -> Path:
        return install.pip_package(self.name, "letta==0.34.12", "letta", timeout=900.0)

    def prepare(self, ws: Workspace) -> dict[str, str]:
        letta = ws.home / ".letta"
        providers = letta / "lc-local-backend" / "providers"
        providers.mkdir(parents=True, exist_ok=True)
        (letta / "settings.json").write_text(json.dumps({"preferredBackendMode": "local", "tokenStreaming": False,
                                                         "autoConversationTitles": False}, indent=2))  # fmt: skip
        stamp = "2026-12-01T09:00:00.000Z"
        provider = {
            "id": "local-provider-openai-compatible",
            "name": "openai-compatible",
            "provider_type": "openai-compatible",
            "provider_category": "byok",
            "auth": {"type": "api", "key": DUMMY_KEY},
            "base_url": ws.openai_base,
            "created_at": stamp,
            "updated_at": stamp,
        }
        (providers / "auth.json").write_text(json.dumps({"version": 1, "providers": {"openai-compatible": provider}}))
        return {}

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        more = ["--new-agent"] if index == 0 else ["--conversation", "local-conv-1"]
        command = [str(binary), "-p", prompt, "-m", f"openai-compatible/{ws.model}", *more, "--output-format", "json"]
        if not self.memory_edits or index == 0 or index % 2:
            return command
        # Before turns 3 and 5: the agent's memory edit (a line in MEMORY.md of its memory repository,
        # committed as its memory tool commits), which Letta Code renders into the system prompt.
        edit = (
            'm=$(ls -d "$HOME"/.letta/lc-local-backend/memfs/*/memory) && '
            'printf -- "- Remembered before turn %s: the user wants one-sentence answers.\n" "$0" >> "$m/MEMORY.md" && '
            'git -C "$m" -c user.name=letta -c user.email=letta@example.invalid commit -qam "update memory" && '
            'exec "$@"'
        )
        return ["sh", "-c", edit, str(index + 1), *command]


class LettaCodeMemory(LettaCode):
    """Letta Code whose memory changes between turns (a line committed to its ``MEMORY.md`` before the third
    and the fifth turn, as its memory tool does): Letta Code appends a ``<memory_update>`` element with the
    freshly rendered memory blocks to the end of the conversation's system prompt."""

    name = "letta-memory"
    memory_edits = True

    def install(self) -> Path:  # the same venv as letta's
        return LettaCode().install()


CLIENTS: dict[str, type[Client]] = {
    c.name: c
    for c in (
        ClaudeCode,
        Codex,
        OpenCode,
        QwenCode,
        Aider,
        OpenWebUI,
        DifyPlugin,
        ContinueCLI,
        KiloCode,
        ClineCLI,
        MistralVibe,
        OpenInterpreter,
        PiCodingAgent,
        Gptme,
        PydanticAIAgent,
        OpenAIAgentsSDK,
        LangGraphAgent,
        SmolagentsAgent,
        LlamaIndexChat,
        AgnoAgent,
        MiniSweAgent,
        AutoGenAgent,
        CrewAIAgent,
        CrewAIReActAgent,
        DeepAgent,
        DeepAgentMemory,
        LettaCode,
        LettaCodeMemory,
    )
}
