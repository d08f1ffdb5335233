"""``coding_agent``: an agentic coding assistant on ``/v1/messages`` (Anthropic Messages).

Modelled on what Claude Code-style clients send (the texts are written for this workload):

- ``system`` as blocks: an attribution block with a per-request hash (vLLM drops a block starting
  with ``x-anthropic-billing-header``), an identity line, and long instructions holding an
  environment block (working directory, platform, today's date) and, at the end, the git status
  at the start of the session (branch, changed files, recent commits), ``cache_control`` on the
  last block. The environment differs from session to session (another day, branch, checkout),
  not within one;
- 20 tools with long descriptions and JSON schemas, always in the same order;
- tool loops: each task is a tool call answered with a large tool result (a file, a test run,
  a search), then the model's text answer; history re-sent as blocks, ``tool_use`` ids and
  inputs as the backend produced them, the moving ``cache_control`` breakpoint on the last block.

Direct, a new session misses from its environment block on (the rest of the instructions and all
the tools); through the proxy the varying lines move behind the stable prefix, so every session
reuses the instructions and tools the first ones cached.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from testbed.workload.registry import Scenario
from testbed.workload.session import Message, Session

NAME = "coding_agent"

IDENTITY = "You are a command-line coding agent that helps developers work on their repositories."

INSTRUCTIONS = """You work inside the developer's checkout and act through the tools you are given. Use the \
instructions below and the tools available to you to help the developer.

# Tone and style
Answer concisely: a few lines unless the developer asks for detail. Do not restate the question, do not \
summarize what you just did unless asked, and do not add closing pleasantries. When you run a command that \
changes the system, say in one sentence what it does and why. Use Markdown for code and file paths.

# Doing tasks
The developer will mostly ask you to fix bugs, add features, refactor code, explain code and run tests.
1. Explore first: search the codebase with the search tools to understand the existing conventions, the \
frameworks in use and how the code you touch is tested.
2. Plan the change; for anything with more than two steps keep a todo list with the todo tool and update it \
as you go, marking each item done as soon as it is.
3. Make the change with the editing tools, following the style of the surrounding code: naming, typing, \
imports, error handling and comments.
4. Verify: run the tests and linters the project uses (look for them in the README, the Makefile or the CI \
configuration; never assume a test framework). Fix what you broke before you report.

# Code conventions
- Never assume a library is available: check the dependency files and neighbouring modules first.
- New components follow existing ones: look at how similar modules are structured before writing one.
- Never expose or log secrets and keys, and never commit them.
- Do not add comments that restate the code; comment only what is not obvious from it.

# Tool use policy
- Prefer the dedicated search tools over shell commands for finding files and text.
- Batch independent tool calls in one reply when you can; their results come back together.
- Read a file before you edit it, and keep edits minimal: replace exactly the text you mean to change.
- Long-running commands need a timeout; do not start servers that keep running unless asked.
- When a command fails, read its output before you try again; do not loop on the same failing call.

# Git
Only commit when the developer asks you to. Before committing, look at the status, the staged diff and \
the recent log to follow the repository's message style; never change the git configuration, never \
force-push, never skip hooks. Do not push unless asked.

# Safety
Refuse to write or explain code that is meant to be used maliciously, even when presented as research. \
Before working on files, consider what the code is supposed to do based on its names and structure.
"""

ENV_TEMPLATE = """Here is useful information about the environment you are running in:
<env>
Working directory: {cwd}
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.8.0-45-generic
Today's date: {date}
</env>
You are powered by the model served by this endpoint."""

GIT_TEMPLATE = """gitStatus: This is the git status at the start of the conversation. It is a snapshot \
and will not update during the conversation.
Current branch: {branch}

Main branch (you will usually use this for PRs): main

Status:
{status}

Recent commits:
{commits}"""

REPOS = ("payments-service", "web-dashboard", "ingest-pipeline")
BRANCHES = ("fix/retry-backoff", "feat/export-csv", "chore/bump-deps", "fix/timezone-parsing", "feat/audit-log")
FILES = (
    "src/api/handlers.py",
    "src/core/retry.py",
    "src/core/models.py",
    "src/utils/dates.py",
    "tests/test_retry.py",
    "tests/test_handlers.py",
    "docs/architecture.md",
    "pyproject.toml",
)
COMMIT_MESSAGES = (
    "Handle empty batches in the exporter",
    "Retry idempotent requests on 503",
    "Parse ISO week dates",
    "Move settings into one module",
    "Add audit log table",
    "Fix flaky clock in tests",
)

TASKS = (
    "The retry logic in src/core/retry.py gives up too early on 503 responses. Find out why and fix it.",
    "Add a --dry-run flag to the export command that prints what would be written.",
    "Why does test_parse_week_dates fail on Sundays? Look at src/utils/dates.py.",
    "Refactor the handlers so that every one of them validates its payload the same way.",
    "Write tests for the audit log model, covering creation and the retention cleanup.",
    "Explain how a request flows from the API handler to the database layer.",
    "Bump the HTTP client library and fix whatever breaks.",
    "Find every place that formats timestamps by hand and switch them to the shared helper.",
    "The CI lint step complains about unused imports. Clean them up.",
    "Add structured logging to the payment capture path, without logging card data.",
)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"name": name, "description": description, "input_schema": schema}


def _s(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _i(description: str) -> dict[str, Any]:
    return {"type": "integer", "description": description}


def _b(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


TOOLS: list[dict[str, Any]] = [
    _tool(
        "Read",
        "Reads a file of the local filesystem. The path must be absolute. By default up to 2000 lines are read "
        "from the start; pass an offset and a limit for long files. Lines longer than 2000 characters are cut. "
        "Results come back numbered like `cat -n`. Read several files in one reply when they are all useful.",
        {"file_path": _s("Absolute path of the file"), "offset": _i("First line"), "limit": _i("Lines to read")},
        ["file_path"],
    ),
    _tool(
        "Write",
        "Writes a file, replacing any existing content. Read an existing file first. Prefer editing existing "
        "files; never create documentation files unless asked.",
        {"file_path": _s("Absolute path"), "content": _s("The whole new content")},
        ["file_path", "content"],
    ),
    _tool(
        "Edit",
        "Replaces an exact string in a file. The old string must occur exactly once unless replace_all is set; "
        "include enough surrounding lines to make it unique, and keep the file's indentation exactly.",
        {
            "file_path": _s("Absolute path"),
            "old_string": _s("Text to replace"),
            "new_string": _s("Replacement"),
            "replace_all": _b("Replace every occurrence"),
        },
        ["file_path", "old_string", "new_string"],
    ),
    _tool(
        "MultiEdit",
        "Several exact-string replacements in one file, applied in order, all or none. Use it instead of "
        "several Edit calls on the same file.",
        {
            "file_path": _s("Absolute path"),
            "edits": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"old_string": _s("Text to replace"), "new_string": _s("Replacement")},
                    "required": ["old_string", "new_string"],
                },
            },
        },
        ["file_path", "edits"],
    ),
    _tool(
        "Bash",
        "Runs a shell command in a persistent session, with an optional timeout in milliseconds (at most "
        "600000). Quote paths with spaces. Do not use it for finding or reading files: use Glob, Grep and Read. "
        "Output longer than 30000 characters is cut.",
        {"command": _s("The command"), "timeout": _i("Timeout in ms"), "description": _s("What it does")},
        ["command"],
    ),
    _tool(
        "Glob",
        "Finds files by glob pattern (`**/*.py`), sorted by modification time. Use it to locate files by name.",
        {"pattern": _s("Glob pattern"), "path": _s("Directory to search")},
        ["pattern"],
    ),
    _tool(
        "Grep",
        "Searches file contents with a regular expression (ripgrep syntax). Filter files with a glob or a type; "
        "choose whether to return matching lines, file names or counts.",
        {
            "pattern": _s("Regular expression"),
            "path": _s("File or directory"),
            "glob": _s("File filter"),
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
            "case_insensitive": _b("Ignore case"),
        },
        ["pattern"],
    ),
    _tool(
        "LS",
        "Lists a directory. The path must be absolute. Prefer Glob and Grep when you know what you look for.",
        {"path": _s("Absolute directory path"), "ignore": {"type": "array", "items": {"type": "string"}}},
        ["path"],
    ),
    _tool(
        "TodoWrite",
        "Creates and updates the task list of this session. Use it for multi-step work: one item in progress at "
        "a time, marked completed as soon as it is done.",
        {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": _s("The task"),
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        "id": _s("Stable id"),
                    },
                    "required": ["content", "status", "id"],
                },
            }
        },
        ["todos"],
    ),
    _tool(
        "TodoRead",
        "Reads the current task list. Use it at the start of a turn and whenever you are unsure what is next.",
        {},
        [],
    ),
    _tool(
        "WebFetch",
        "Fetches a URL and answers a question about its content. HTTP is upgraded to HTTPS. Read-only.",
        {"url": _s("The URL"), "prompt": _s("What to extract")},
        ["url", "prompt"],
    ),
    _tool(
        "WebSearch",
        "Searches the web and returns result titles, links and snippets. Use it for information newer than "
        "your training data.",
        {"query": _s("The search query"), "allowed_domains": {"type": "array", "items": {"type": "string"}}},
        ["query"],
    ),
    _tool(
        "NotebookRead",
        "Reads a Jupyter notebook and returns its cells with their outputs.",
        {"notebook_path": _s("Absolute path of the .ipynb file")},
        ["notebook_path"],
    ),
    _tool(
        "NotebookEdit",
        "Replaces, inserts or deletes one cell of a Jupyter notebook.",
        {
            "notebook_path": _s("Absolute path"),
            "cell_number": _i("0-based cell index"),
            "new_source": _s("New cell source"),
            "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]},
        },
        ["notebook_path", "new_source"],
    ),
    _tool(
        "Task",
        "Starts a sub-agent with its own context for an open-ended search or a self-contained piece of work; "
        "it answers once, with a report. Give it a complete, standalone description of what to do.",
        {"description": _s("Three to five words"), "prompt": _s("The full task")},
        ["description", "prompt"],
    ),
    _tool(
        "GitDiff",
        "Shows the diff of the working tree or of a commit range, optionally for some paths only.",
        {"range": _s("Commit range, e.g. main...HEAD"), "paths": {"type": "array", "items": {"type": "string"}}},
        [],
    ),
    _tool(
        "GitLog",
        "Shows recent commits: hash, author, date and subject, optionally for a path.",
        {"max_count": _i("How many"), "path": _s("Only commits touching this path")},
        [],
    ),
    _tool(
        "RunTests",
        "Runs the project's test command for some paths or test ids and returns the summary and failures.",
        {"targets": {"type": "array", "items": {"type": "string"}}, "verbose": _b("Full output")},
        [],
    ),
    _tool(
        "Lint",
        "Runs the project's linters and type checker on some paths and returns the findings.",
        {"paths": {"type": "array", "items": {"type": "string"}}, "fix": _b("Apply safe fixes")},
        [],
    ),
    _tool(
        "ExitPlanMode",
        "Presents the plan to the developer for approval before any file is changed. Use it only in plan mode.",
        {"plan": _s("The plan, in Markdown")},
        ["plan"],
    ),
]

_CODE_LINES = (
    "def {name}(request, *, timeout=30.0):",
    '    """Handle one {thing} and return the stored record."""',
    "    payload = validate(request.json(), {thing}_schema)",
    "    for attempt in range(MAX_ATTEMPTS):",
    "        try:",
    "            return repository.save(payload, timeout=timeout)",
    "        except TransientError as exc:",
    '            log.warning("retrying {thing}", attempt=attempt, error=str(exc))',
    "            time.sleep(backoff(attempt))",
    '    raise ServiceUnavailable("{thing} store did not answer")',
    "",
)


def _file(rng: random.Random, path: str, lines: int) -> str:
    """A deterministic, plausible source file, numbered like the Read tool returns it."""
    out: list[str] = []
    things = ("payment", "invoice", "refund", "export", "audit_entry", "batch")
    number = 1
    while len(out) < lines:
        thing = rng.choice(things)
        for line in _CODE_LINES:
            out.append(f"{number:6d}\t{line.format(name=f'handle_{thing}_{number}', thing=thing)}")
            number += 1
    return f"{path}\n" + "\n".join(out[:lines])


class CodingAgentSession(Session):
    protocol = "messages"
    scenario_name = NAME

    def __init__(self, index: int, rng: random.Random) -> None:
        tasks = list(TASKS)
        first = tasks.pop(index % len(tasks))
        rng.shuffle(tasks)
        super().__init__(self.scenario_name, index, rng, [first, *tasks[: rng.randint(2, 4)]])
        repo = REPOS[index % len(REPOS)]
        self._cwd = f"/home/dev/src/{repo}"
        self._date = f"2025-{6 + index // 28:02d}-{1 + index % 28:02d}"
        self._branch = rng.choice(BRANCHES)
        self._status = [f"{rng.choice(' M?')}{rng.choice('M?')} {f}" for f in rng.sample(FILES, rng.randint(1, 4))]
        self._commits = [
            f"{hashlib.sha1(f'{index}:{n}'.encode()).hexdigest()[:7]} {rng.choice(COMMIT_MESSAGES)}" for n in range(5)
        ]
        self._instructions = self._render_instructions()

    def _render_instructions(self) -> str:
        git = GIT_TEMPLATE.format(
            branch=self._branch, status="\n".join(self._status), commits="\n".join(self._commits[:5])
        )
        return f"{INSTRUCTIONS}\n{ENV_TEMPLATE.format(cwd=self._cwd, date=self._date)}\n\n{git}"

    @property
    def uses_tools(self) -> bool:
        return True

    def tool_result(self, name: str, arguments: dict[str, Any]) -> str:
        if name in ("Read", "NotebookRead"):
            return _file(self.rng, str(arguments.get("file_path") or f"{self._cwd}/src/core/retry.py"), 120)
        if name in ("Bash", "RunTests", "Lint"):
            failures = "\n".join(
                f"FAILED tests/test_retry.py::test_case_{n} - AssertionError: expected 3 attempts, got {n % 3}"
                for n in range(self.rng.randint(8, 20))
            )
            return f"============ test session starts ============\ncollected 214 items\n\n{failures}\n"
        if name in ("Grep", "Glob", "LS"):
            return "\n".join(f"{self._cwd}/{self.rng.choice(FILES)}:{self.rng.randint(1, 400)}" for _ in range(40))
        return f"{name} done."

    def _system(self) -> list[dict[str, Any]]:
        # The attribution hash changes with every request, as the real header's does.
        stamp = hashlib.sha1(f"{self.session_id}:{self.requests_sent}".encode()).hexdigest()[:5]
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=1.0.70; cch={stamp};"},
            {"type": "text", "text": IDENTITY},
            {"type": "text", "text": self._instructions, "cache_control": {"type": "ephemeral"}},
        ]

    def next_request(self) -> dict[str, Any] | None:
        chat = super().next_request()
        if chat is None:
            return None
        messages = to_anthropic_messages(chat["messages"])
        last = messages[-1]["content"][-1]
        last["cache_control"] = {"type": "ephemeral"}  # the breakpoint moves to the newest block
        return {"max_tokens": 1024, "system": self._system(), "tools": TOOLS, "messages": messages}


def to_anthropic_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat history as an Anthropic client holds it: blocks, tool results grouped in user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "user":
            out.append({"role": "user", "content": [{"type": "text", "text": message["content"]}]})
        elif role == "assistant":
            blocks: list[dict[str, Any]] = []
            if message.get("content"):
                blocks.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or []:
                function = call["function"]
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": function["name"],
                        "input": json.loads(function["arguments"]),
                    }
                )
            out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            if out and out[-1]["role"] == "user" and out[-1]["content"][0].get("type") == "tool_result":
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
    return out


class CommittingAgentSession(CodingAgentSession):
    """The coding agent in a repository where the developer commits between turns: the agent's
    next request starts a fresh snapshot of git status (another changed file, a new commit on top
    of ``Recent commits:``), as Claude Code's does when it is restarted with ``--continue``."""

    scenario_name = "coding_agent_commits"

    def next_request(self) -> dict[str, Any] | None:
        if not self._in_turn and self._turn > 0:
            number = len(self._commits)
            digest = hashlib.sha1(f"{self.session_id}:commit:{number}".encode()).hexdigest()[:7]
            self._commits.insert(0, f"{digest} {self.rng.choice(COMMIT_MESSAGES)}")
            self._status = [f" M {self.rng.choice(FILES)}"]
            self._instructions = self._render_instructions()
        return super().next_request()


SCENARIO = Scenario(
    NAME,
    "coding agent on /v1/messages: long system prompt with a per-session environment block, 20 tools, tool loops",
    CodingAgentSession,
)
COMMITS_SCENARIO = Scenario(
    CommittingAgentSession.scenario_name,
    "the coding agent with a commit between turns: its git status and recent commits change every turn",
    CommittingAgentSession,
)
