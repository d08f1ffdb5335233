"""One client, one mode: a fresh backend (or a fresh prefix cache), the recorders, the proxy, N turns.

Topology (every hop real HTTP on 127.0.0.1):

    direct:     client -> backend recorder -> backend
    via proxy:  client -> client recorder -> proxy (``prefix-proxy serve``, defaults) -> backend recorder -> backend

The backend recorder sees what the backend received; the client recorder what the client sent. The
prefill is counted by the backend: ``vllm:prefix_cache_queries_total`` (prompt tokens) and
``vllm:prefix_cache_hits_total`` (cached tokens) read from its ``/metrics`` before and after the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import servers
from bench.clients.audit import audit, torn_units
from bench.clients.clients import CLIENTS, Client, Workspace
from bench.clients.recorder import Exchange, Recorder
from bench.real_vllm.engine import parse_prefix_cache_counters
from testbed.fakevllm.app import create_app as create_fake_app
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.replies import plain_text
from testbed.serving import LiveServer

PROMPTS = (
    "Briefly, what is this repository for? Answer in one sentence and do not use any tools.",
    "Suggest a clearer name for the function in main.py. Just answer, no tools and no edits.",
    "What would be a good next commit for this repository? One sentence, no tools.",
    "Thanks. Anything else worth watching out for here? One sentence, no tools.",
)
TURN_MARK = re.compile(r"\[turn (\d+)\]")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions")
GIT_ENV = {
    "GIT_AUTHOR_NAME": "Bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "Bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
    "GIT_AUTHOR_DATE": "2026-12-01T09:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-12-01T09:00:00+00:00",
}


def prompt_of(turn: int) -> str:
    return f"[turn {turn + 1}] {PROMPTS[turn % len(PROMPTS)]}"


def text_reply(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The fake's ``fake_options.reply`` for a generation request: plain text (no tool call), the
    same for every request of a turn wherever it comes from, so direct and proxied runs match."""
    if path not in GENERATION_PATHS:
        return None
    turns = [int(n) for n in TURN_MARK.findall(json.dumps(body))]
    turn = max(turns) if turns else 0
    reply = f"Turn {turn} answer: {plain_text(f'turn {turn}')}" if turn else plain_text("side request")
    return {**body, "fake_options": {"reply": reply}}


@dataclass
class Backend:
    """Where the backend is and how to read its counters; ``fresh()`` empties its prefix cache."""

    url: str  # server root
    model: str
    engine: str
    reset: Any = None

    def counters(self) -> tuple[float, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        counters = parse_prefix_cache_counters(text)
        return counters.queries, counters.hits

    def settled_counters(self, previous: tuple[float, float] | None = None) -> tuple[float, float]:
        """The counters once they stop moving (vLLM updates them just after the response)."""
        last = self.counters()
        for _ in range(20):
            time.sleep(0.25 if self.engine == "fake" else 0.5)
            now = self.counters()
            if now == last:
                return now
            last = now
        return last


@contextlib.contextmanager
def fake_backend(model: str = "fake-model") -> Iterator[Backend]:
    # Agents ask for up to 32k output tokens on top of 20k-token prompts: room for both.
    config = FakeBackendConfig(model=model, max_model_len=262144, request_log_size=100_000)
    with LiveServer(create_fake_app(config), name="fake-vllm") as server:

        def reset() -> None:  # the prefix cache, the counters and the request log
            httpx.post(server.url + "/fake/reset", timeout=10).raise_for_status()

        yield Backend(server.url, model, "fake", reset)


@dataclass
class TurnResult:
    turn: int
    argv: list[str]
    exit_code: int | None
    seconds: float
    timed_out: bool = False
    output_tail: str = ""


@dataclass
class RunResult:
    client: str
    mode: str  # direct | proxy
    scenario: str  # plain | commits
    engine: str
    turns: list[TurnResult] = field(default_factory=list)
    client_requests: int = 0
    backend_requests: int = 0
    generation_requests: int = 0
    http_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    foreign: list[dict[str, Any]] = field(default_factory=list)
    torn: list[dict[str, Any]] = field(default_factory=list)  # client system texts that arrived with units torn
    paths: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    cache_breaks: list[str] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    session_headers: list[str] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    per_request: list[dict[str, Any]] = field(default_factory=list)  # the backend's usage, request by request
    seconds: float = 0.0
    skipped: str | None = None

    @property
    def exit_errors(self) -> int:
        return sum(1 for t in self.turns if t.exit_code != 0)

    @property
    def errors(self) -> int:
        return self.http_errors + self.exit_errors

    @property
    def prefill(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "client": self.client,
            "mode": self.mode,
            "scenario": self.scenario,
            "engine": self.engine,
            "skipped": self.skipped,
            "turns": [t.__dict__ for t in self.turns],
            "client_requests": self.client_requests,
            "backend_requests": self.backend_requests,
            "generation_requests": self.generation_requests,
            "http_errors": self.http_errors,
            "exit_errors": self.exit_errors,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill,
            "hit_rate": round(self.hit_rate, 4),
            "foreign_text_requests": len(self.foreign),
            "foreign_text": self.foreign[:10],
            "torn_unit_requests": len({t["backend_seq"] for t in self.torn}),
            "torn_units": sum(t["torn_count"] for t in self.torn),
            "lost_lines": sum(t["lost_count"] for t in self.torn),
            "torn": self.torn[:10],
            "paths": self.paths,
            "statuses": self.statuses,
            "cache_breaks": self.cache_breaks,
            "proxy_actions": self.actions,
            "session_headers": self.session_headers,
            "error_samples": self.error_samples[:5],
            "per_request_usage": self.per_request,
            "seconds": round(self.seconds, 1),
        }


def make_repo(repo: Path) -> None:
    repo.mkdir(parents=True)
    (repo / "README.md").write_text("# tiny-calc\n\nA tiny calculator used to benchmark coding agents.\n")
    (repo / "main.py").write_text(
        "def f(a, b):\n    return a + b\n\n\nif __name__ == '__main__':\n    print(f(2, 3))\n"
    )
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "Initial commit")


def commit_between_turns(repo: Path, turn: int) -> None:
    """What a developer does between two agent turns: change a file and commit it."""
    (repo / f"notes_{turn + 1}.md").write_text(f"Note {turn + 1}: checked the calculator by hand.\n")
    with (repo / "main.py").open("a") as handle:
        handle.write(f"\n# reviewed in round {turn + 1}\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", f"Review round {turn + 1}")


def edit_between_turns(repo: Path, turn: int) -> None:
    """What a developer does while an agent session goes on: edit files and not commit them (after the
    first and the third turn: ``git status --short`` changes, an untracked file appears)."""
    if turn == 0:
        with (repo / "main.py").open("a") as handle:
            handle.write("\n\ndef g(a, b):\n    return a * b\n")
        (repo / "test_calc.py").write_text("from main import f\n\n\ndef test_f():\n    assert f(2, 3) == 5\n")
    elif turn == 2:
        with (repo / "README.md").open("a") as handle:
            handle.write("\nRun the tests with `pytest`.\n")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, env={**os.environ, **GIT_ENV}, capture_output=True)


def client_env(ws: Workspace, extra: dict[str, str]) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "TZ")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        {
            "HOME": str(ws.home),
            "XDG_CONFIG_HOME": str(ws.home / ".config"),
            "XDG_CACHE_HOME": str(ws.home / ".cache"),
            "XDG_DATA_HOME": str(ws.home / ".local" / "share"),
            "XDG_STATE_HOME": str(ws.home / ".local" / "state"),
            "TMPDIR": str(ws.home / "tmp"),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "CI": "1",
            "NO_COLOR": "1",
            "TERM": "dumb",
            **GIT_ENV,
        }
    )
    (ws.home / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(extra)
    return env


def run_client(
    client: Client,
    binary: Path,
    backend: Backend,
    *,
    mode: str,
    turns: int,
    commits: bool,
    turn_timeout: float,
    log_dir: Path,
    inject_text_replies: bool = True,
    edits: bool = False,
) -> RunResult:
    """``turns`` turns of ``client`` against ``backend`` (directly or through a fresh proxy); ``commits``: a
    commit between turns, ``edits``: uncommitted edits after the first and the third turn."""
    scenario = "commits" if commits else "edits" if edits else "plain"
    result = RunResult(client.name, mode, scenario, backend.engine)
    if backend.reset is not None:
        backend.reset()
    started = time.monotonic()
    before = backend.settled_counters()
    inject = text_reply if inject_text_replies else None
    backend_rec = Recorder(backend.url, inject=inject, name="backend-recorder")
    log_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{client.name}-{result.scenario}-{mode}"
    with contextlib.ExitStack() as stack:
        backend_server = stack.enter_context(LiveServer(backend_rec, name="backend-recorder"))
        client_rec: Recorder | None = None
        if mode == "proxy":
            proxy_log = stack.enter_context((log_dir / f"{tag}.proxy.log").open("wb"))
            proxy_v1 = stack.enter_context(servers.proxy(backend_server.url + "/v1", stderr=proxy_log))
            client_rec = Recorder(proxy_v1.removesuffix("/v1"), name="client-recorder")
            base = stack.enter_context(LiveServer(client_rec, name="client-recorder")).url
        else:
            base = backend_server.url
        # Outside the project's checkout: agents read instructions files (CLAUDE.md, AGENTS.md) up the tree.
        # The same path in both modes (and commits dated alike, GIT_ENV): the agents write it into
        # their prompts, and a random one tokenizes to a few tokens more or less in each run.
        root = Path(tempfile.gettempdir()) / f"bench-{client.name}-{result.scenario}"
        shutil.rmtree(root, ignore_errors=True)
        stack.callback(shutil.rmtree, root, True)
        ws = Workspace(home=root / "home", repo=root / "repo", base_url=base, model=backend.model)
        ws.home.mkdir(parents=True)
        make_repo(ws.repo)
        env = client_env(ws, client.prepare(ws))
        stack.enter_context(client.serve(binary, ws, env, log_dir / f"{tag}.server.log"))  # Open WebUI's server
        for turn in range(turns):
            result.turns.append(
                _one_turn(client, binary, ws, env, turn, turn_timeout, log_dir / f"{tag}.turn{turn + 1}.log")
            )
            if commits and turn < turns - 1:
                commit_between_turns(ws.repo, turn)
            if edits and turn < turns - 1:
                edit_between_turns(ws.repo, turn)
        time.sleep(0.5)  # a client's last background request (titles, telemetry it still sends)
    after = backend.settled_counters()
    result.prompt_tokens = int(after[0] - before[0])
    result.cached_tokens = int(after[1] - before[1])
    backend_ex = backend_rec.snapshot()
    client_ex = client_rec.snapshot() if client_rec is not None else backend_ex
    _fill(result, client_ex, backend_ex, proxied=client_rec is not None)
    result.seconds = time.monotonic() - started
    _dump(log_dir / f"{tag}.exchanges.json", client_ex, backend_ex, proxied=client_rec is not None)
    return result


def _one_turn(
    client: Client, binary: Path, ws: Workspace, env: dict[str, str], turn: int, timeout: float, log: Path
) -> TurnResult:
    argv = client.turn(binary, ws, turn, prompt_of(turn))
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ws.repo, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        timed_out = False
        code: int | None = None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Whatever the client left running in its process group (a local server, a language server),
            # and the client itself on a timeout or when the bench is stopped.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = log.read_text(errors="replace")[-600:]
    return TurnResult(turn + 1, _redact(argv), code, round(time.monotonic() - started, 1), timed_out, tail)


def _redact(argv: list[str]) -> list[str]:
    return [a if not a.startswith("sk-") else "sk-..." for a in argv]


def usage_of(exchange: Exchange) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from the backend's answer, JSON or SSE, in the route's terms."""
    text = bytes(exchange.response_body).decode("utf-8", "replace")
    found: dict[str, Any] | None = None
    candidates: list[Any] = []
    if text.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            candidates.append(json.loads(text))
    else:
        for line in text.splitlines():
            if line.startswith("data:") and '"usage"' in line:
                with contextlib.suppress(ValueError):
                    candidates.append(json.loads(line[5:]))
    for event in candidates:
        if not isinstance(event, dict):
            continue
        for holder in (event, event.get("response"), event.get("message")):
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                found = holder["usage"]
    if found is None:
        return None
    if "prompt_tokens" in found:  # chat completions
        details = found.get("prompt_tokens_details") or {}
        return int(found["prompt_tokens"]), int(details.get("cached_tokens") or 0)
    if "cache_read_input_tokens" in found or "cache_creation_input_tokens" in found:  # Anthropic
        cached = int(found.get("cache_read_input_tokens") or 0)
        return int(found.get("input_tokens") or 0) + cached + int(found.get("cache_creation_input_tokens") or 0), cached
    if "input_tokens" in found:  # Responses
        details = found.get("input_tokens_details") or {}
        return int(found["input_tokens"]), int(details.get("cached_tokens") or 0)
    return None


def _fill(result: RunResult, client_ex: list[Exchange], backend_ex: list[Exchange], *, proxied: bool) -> None:
    result.client_requests = len(client_ex)
    result.backend_requests = len(backend_ex)
    result.generation_requests = sum(1 for e in backend_ex if e.path.split("?")[0] in GENERATION_PATHS)
    paths: Counter[str] = Counter(f"{e.method} {e.path.split('?')[0]}" for e in client_ex)
    result.paths = dict(paths)
    result.statuses = dict(Counter(str(e.status) for e in client_ex))
    for e in client_ex:
        if e.method == "HEAD":  # reachability probes (Claude Code's HEAD /): vLLM answers 404 too
            continue
        if not 200 <= e.status < 300 or e.error:
            result.http_errors += 1
            answer = bytes(e.response_body[:300]).decode("utf-8", "replace")
            result.error_samples.append(f"{e.method} {e.path} -> {e.status} {e.error or ''} {answer}")
    headers = sorted({k for e in client_ex for k in e.headers if "session" in k or k.endswith("chat-id")})
    result.session_headers = headers
    if proxied:
        by_id = {e.response_headers.get("x-request-id", ""): e for e in client_ex}
        pairs = [(b, by_id.get(b.headers.get("x-request-id", ""))) for b in backend_ex]
        actions: Counter[str] = Counter()
        for e in client_ex:
            brk = e.response_headers.get("x-prefix-proxy-cache-break")
            if brk:
                result.cache_breaks.append(brk)
            for action in filter(
                None, (a.strip() for a in e.response_headers.get("x-prefix-proxy-actions", "").split(","))
            ):
                actions[action.split("=")[0].split(":")[0]] += 1
        result.actions = dict(actions)
    else:
        pairs = [(b, b) for b in backend_ex]
    result.foreign = [f.to_json() for f in audit(pairs)]
    result.torn = [t.to_json() for t in torn_units(pairs)]
    for e in backend_ex:
        if e.path.split("?")[0] in GENERATION_PATHS:
            usage = usage_of(e)
            result.per_request.append(
                {
                    "path": e.path.split("?")[0],
                    "status": e.status,
                    "prompt": usage and usage[0],
                    "cached": usage and usage[1],
                }
            )


def _dump(path: Path, client_ex: list[Exchange], backend_ex: list[Exchange], *, proxied: bool) -> None:
    data = {"backend": [e.to_json() for e in backend_ex]}
    if proxied:
        data["client"] = [e.to_json() for e in client_ex]
    path.write_text(json.dumps(data, indent=1, default=str))


CLIENT_NAMES = tuple(CLIENTS)
