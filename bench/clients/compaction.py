"""Coding agents compacting mid-session: Codex through the proxy's summarizer against compacting
locally, and Claude Code's own compaction (``/compact``), directly and through the proxy.

    python -m bench.clients.compaction [--client codex|claude-code] [--engine fake|real-vllm] [--turns 3]
                                       [--compact-limit 1000] [--turn-timeout 240]

The real Codex (npm ``@openai/codex``, installed as ``python -m bench.clients`` installs it), with a low
``model_auto_compact_token_limit`` so that it compacts before its second turn, against the fake vLLM or
the real one (``bench/real_vllm``, 32k context; its prefix cache reset before each run):

- ``remote via proxy``: ``[model_providers.X.capabilities] remote_compaction = "v2"``, through the proxy:
  Codex sends its ``compaction_trigger`` request, the proxy's summarizer answers it with one
  ``compaction`` item (docs/compaction.md), and Codex's next turns carry that item back;
- ``local direct``: ``remote_compaction = "unsupported"`` (the default for a custom provider), straight to
  the backend: Codex sends the history plus its own summarization prompt as a turn, then the history
  rebuilt around the summary;
- ``local via proxy``: the same local compaction through the proxy.

For each: the requests (client / backend), the prefill (prompt - cached, as the backend counted it) of the
compaction request and of the turn after it, and of the whole run. Codex marks its compaction requests
(``x-codex-turn-metadata``: ``"request_kind": "compaction"``); through the proxy each backend request is
matched to the client's by ``x-request-id``. Writes ``bench/results/<client>-compaction-<date>.md|json``.

``--client claude-code``: Claude Code 2.1.197 runs ``/compact`` as its next-to-last turn (``claude -p
/compact --resume``), directly and through the proxy. It compacts locally, always: its summarization
request is the conversation with the same system prompt and tools, its instruction appended to the last
user message (the request whose last user message asks for ``<summary>``, counted as the compaction),
then the next turn starts from the summary. It never sends Anthropic's ``compaction`` parameter or a
``compact_20260112`` edit, so the proxy has nothing of its own to serve: the run shows what its
compaction costs, and that the proxy does not make it cost more.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import install
from bench.clients.clients import ClaudeCode, Client, Codex, Workspace
from bench.clients.install import WORK
from bench.clients.recorder import Exchange
from bench.clients.run import GENERATION_PATHS, TURN_MARK, run_client, usage_of

RESULTS = Path(__file__).resolve().parents[1] / "results"


class CodexCompacting(Codex):
    """Codex with a low auto-compaction limit, compacting remotely (v2) or locally."""

    def __init__(self, remote: bool, limit: int) -> None:
        self.remote = remote
        self.limit = limit
        self.name = f"codex-compact-{'remote' if remote else 'local'}"

    def install(self) -> Path:
        return install.npm_package(Codex.name, "@openai/codex@0.171.0", "codex")  # the bench's one install

    def prepare(self, ws: Workspace) -> dict[str, str]:
        env = super().prepare(ws)
        config = ws.home / ".codex" / "config.toml"
        # Top-level keys before the first table; the provider's capabilities as a table of their own.
        config.write_text(
            f"model_auto_compact_token_limit = {self.limit}\n"
            "model_context_window = 100000\n"
            + config.read_text()
            + "[model_providers.bench.capabilities]\n"
            + f'remote_compaction = "{"v2" if self.remote else "unsupported"}"\n'
        )
        return env


class ClaudeCodeCompacting(ClaudeCode):
    """Claude Code, running ``/compact`` as its turn ``compact_at`` (0-based)."""

    def __init__(self, compact_at: int) -> None:
        self.compact_at = compact_at

    def turn(self, binary: Path, ws: Workspace, index: int, prompt: str) -> list[str]:
        return super().turn(binary, ws, index, "/compact" if index == self.compact_at else prompt)


def _exchange(data: dict[str, Any]) -> Exchange:
    body = data.get("body")
    raw = json.dumps(body).encode() if isinstance(body, dict | list) else str(body or "").encode()
    exchange = Exchange(data["seq"], data["method"], data["path"], data["request_headers"], raw)
    exchange.status = data["status"]
    exchange.response_headers = data["response_headers"]
    exchange.response_body = bytearray(str(data.get("response_body") or "").encode())
    return exchange


def request_kind(exchange: Exchange) -> str:
    """``compaction`` or ``turn`` (Codex's own mark; Claude Code's: below), ``trigger`` for a remote
    compaction request."""
    body = exchange.json_body()
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return _claude_code_kind(body["messages"])
    items = body.get("input") if isinstance(body, dict) else None
    if (
        isinstance(items, list)
        and items
        and isinstance(items[-1], dict)
        and items[-1].get("type") == "compaction_trigger"
    ):
        return "trigger"
    try:
        metadata = json.loads(exchange.headers.get("x-codex-turn-metadata", "{}"))
    except ValueError:
        metadata = {}
    return str(metadata.get("request_kind") or "other")


def _claude_code_kind(messages: list[Any]) -> str:
    """Claude Code's: ``compaction`` for its summarization request (its instruction, which asks for a
    ``<summary>`` block, appended to the last user message), ``turn`` for a request whose last user
    message is one of the bench's prompts, ``other`` for anything else."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    texts = [content] if isinstance(content, str) else [
        b.get("text", "") for b in content or [] if isinstance(b, dict) and isinstance(b.get("text"), str)
    ]  # fmt: skip
    if any("<summary>" in text for text in texts):
        return "compaction"
    return "turn" if any(TURN_MARK.search(text) for text in texts) else "other"


def analyse(dump: Path) -> dict[str, Any]:
    """Per backend generation request: its kind (from the client request it was made for), prompt,
    cached and prefill tokens; the compaction request and the turn after it."""
    data = json.loads(dump.read_text())
    backend = [_exchange(e) for e in data["backend"]]
    client = [_exchange(e) for e in data.get("client", data["backend"])]
    by_id = {e.response_headers.get("x-request-id", ""): e for e in client}
    rows = []
    for exchange in backend:
        if exchange.path.split("?")[0] not in GENERATION_PATHS:
            continue
        origin = by_id.get(exchange.headers.get("x-request-id", ""), exchange) if "client" in data else exchange
        usage = usage_of(exchange) or (0, 0)
        rows.append(
            {
                "kind": request_kind(origin),
                "status": exchange.status,
                "prompt": usage[0],
                "cached": usage[1],
                "prefill": usage[0] - usage[1],
            }
        )
    compaction = next((i for i, r in enumerate(rows) if r["kind"] in ("trigger", "compaction")), None)
    after = None
    if compaction is not None:
        after = next((r for r in rows[compaction + 1 :] if r["kind"] == "turn"), None)
    return {
        "requests": rows,
        "compaction": rows[compaction] if compaction is not None else None,
        "turn_after": after,
        "compactions": sum(1 for r in rows if r["kind"] in ("trigger", "compaction")),
        "compaction_prefill": [r["prefill"] for r in rows if r["kind"] in ("trigger", "compaction")],
        "client_items": _client_items(client),
    }


def _client_items(client: list[Exchange]) -> dict[str, int]:
    """How many requests the client sent with a compaction_trigger, and with a compaction item."""
    counts = {"compaction_trigger": 0, "compaction": 0}
    for exchange in client:
        body = exchange.json_body()
        items = body.get("input") if isinstance(body, dict) else None
        kinds = {i.get("type") for i in items if isinstance(i, dict)} if isinstance(items, list) else set()
        for kind in counts:
            counts[kind] += kind in kinds
    return counts


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    setting = f"model_auto_compact_token_limit {meta['limit']}" if meta["client"] == "codex" else "/compact"
    lines = [
        f"`{meta['command']}` ({meta['engine']} backend, {meta['client']} {meta['version']}, {meta['turns']} turns, "
        f"{setting}, {meta['date']})",
        "",
        "| run | exits | requests (client / backend) | compactions | compaction request: prompt / cached / prefill "
        "| turn after it: prompt / cached / prefill | every compaction request's prefill | run prefill | hit rate |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        c, a = run["analysis"]["compaction"], run["analysis"]["turn_after"]

        def cell(r: dict[str, Any] | None) -> str:
            return f"{r['prompt']:,} / {r['cached']:,} / {r['prefill']:,}" if r else "none"

        exits = ",".join("T" if t["timed_out"] else str(t["exit_code"]) for t in run["result"]["turns"])
        result = run["result"]
        lines.append(
            f"| {run['label']} | {exits} | {result['client_requests']} / {result['backend_requests']} "
            f"| {run['analysis']['compactions']} | {cell(c)} | {cell(a)} "
            f"| {' + '.join(f'{r:,}' for r in run['analysis']['compaction_prefill']) or 'none'} "
            f"| {result['prefill_tokens']:,} "
            f"| {result['hit_rate']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients.compaction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--client", choices=("codex", "claude-code"), default="codex")
    parser.add_argument("--engine", choices=("fake", "real-vllm"), default="fake")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--compact-limit", type=int, default=1000, help="model_auto_compact_token_limit")
    parser.add_argument("--turn-timeout", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = WORK / "logs" / f"compaction-{stamp}"
    variants: list[tuple[str, Client, str]]
    if args.client == "codex":
        variants = [
            ("remote via proxy", CodexCompacting(True, args.compact_limit), "proxy"),
            ("local direct", CodexCompacting(False, args.compact_limit), "direct"),
            ("local via proxy", CodexCompacting(False, args.compact_limit), "proxy"),
        ]
    else:
        at = max(1, args.turns - 2)  # one turn after it, at least one before
        variants = [
            ("local direct", ClaudeCodeCompacting(at), "direct"),
            ("local via proxy", ClaudeCodeCompacting(at), "proxy"),
        ]
    runs = []
    version = "?"
    from bench.clients.__main__ import backend_for

    with backend_for(args.engine) as backend:
        for label, client, mode in variants:
            binary = client.install()
            if version == "?":
                from bench.clients.__main__ import version_of

                version = version_of(binary)
            print(f"running {label} ...", file=sys.stderr, flush=True)
            result = run_client(
                client, binary, backend, mode=mode, turns=args.turns, commits=False,
                turn_timeout=args.turn_timeout, log_dir=log_dir,
            )  # fmt: skip
            dump = log_dir / f"{client.name}-plain-{mode}.exchanges.json"
            runs.append({"label": label, "result": result.to_json(), "analysis": analyse(dump)})
    meta = {
        "command": "python -m bench.clients.compaction " + " ".join(argv if argv is not None else sys.argv[1:]),
        "version": version,
        "client": args.client,
        "engine": args.engine,
        "turns": args.turns,
        "limit": args.compact_limit,
        "date": stamp,
        "logs": str(log_dir),
    }
    table = markdown(meta, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{args.client}-compaction-{stamp}"
    base.with_suffix(".md").write_text(table)
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(table)
    print(f"wrote {base}.md and .json; logs in {log_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
