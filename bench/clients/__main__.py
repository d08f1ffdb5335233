"""Real clients, headless, multi-turn, against the fake (or real) vLLM, directly and through the proxy.

    python -m bench.clients [--clients claude-code,codex,opencode,qwen-code,aider[,open-webui]] [--turns 4]
                            [--engine fake|real-vllm] [--commits-between-turns | --scenarios plain,commits]
                            [--modes direct,proxy] [--turn-timeout 240] [--update-doc]

Installs each client into bench/clients/.work (cached), runs it in a fresh HOME and git repository,
and prints per client and mode: requests, errors (non-2xx and client exit codes), prompt tokens,
cached tokens and prefill (prompt - cached, from the backend's own counters), hit rate, and the
requests the backend got with text the client did not send. Writes bench/results/clients-*.md|json;
``--update-doc`` also rewrites the table in docs/clients.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.clients import report
from bench.clients.clients import CLIENTS
from bench.clients.install import WORK, Unavailable
from bench.clients.run import Backend, RunResult, fake_backend, run_client

RESULTS = Path(__file__).resolve().parents[1] / "results"


@contextlib.contextmanager
def backend_for(engine: str, max_model_len: int = 32768) -> Iterator[Backend]:
    if engine == "fake":
        with fake_backend() as backend:
            yield backend
        return
    from bench.real_vllm.engine import RealVLLM, unavailable_reason

    why = unavailable_reason(install=True)
    if why:
        raise Unavailable(why)
    with RealVLLM(port=None, max_model_len=max_model_len, extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as engine_:
        import httpx

        def reset() -> None:
            httpx.post(engine_.base_url + "/reset_prefix_cache", timeout=30)

        yield Backend(engine_.base_url, engine_.model, "real-vllm", reset)


def version_of(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        return (out.stdout or out.stderr).strip().splitlines()[0][:60]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "?"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--clients", default="claude-code,codex,opencode,qwen-code,aider")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--engine", choices=("fake", "real-vllm"), default="fake")
    p.add_argument("--modes", default="direct,proxy")
    p.add_argument(
        "--max-model-len", type=int, default=32768, help="the real engine's context (the tiny model holds 32768)"
    )
    p.add_argument("--scenarios", default=None, help="plain,commits,edits (default: plain)")
    p.add_argument("--commits-between-turns", action="store_true", help="the commits scenario (coding agents)")
    p.add_argument("--turn-timeout", type=float, default=240.0, help="seconds per client process")
    p.add_argument("--policy-replies", action="store_true",
                   help="let the fake's reply policy answer (tool calls when tools are declared)")  # fmt: skip
    p.add_argument("--update-doc", action="store_true", help="rewrite the table in docs/clients.md")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: client process groups, the proxy and the servers are stopped


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    scenarios = (args.scenarios or ("commits" if args.commits_between_turns else "plain")).split(",")
    modes = args.modes.split(",")
    unavailable: dict[str, str] = {}
    ready = []
    versions: dict[str, str] = {}
    for name in names:
        if name not in CLIENTS:
            unavailable[name] = f"unknown client (known: {', '.join(CLIENTS)})"
            continue
        client = CLIENTS[name]()
        try:
            print(f"installing {name} ...", file=sys.stderr, flush=True)
            binary = client.install()
        except Unavailable as exc:
            unavailable[name] = str(exc)
            continue
        versions[name] = version_of(binary)
        ready.append((client, binary))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = WORK / "logs" / f"run-{stamp}"
    runs: list[RunResult] = []
    model = "?"
    with backend_for(args.engine, args.max_model_len) as backend:
        model = backend.model
        for client, binary in ready:
            for scenario in scenarios:
                if scenario in ("commits", "edits") and not client.coding_agent:
                    continue
                for mode in modes:
                    print(f"running {client.name} {scenario} {mode} ...", file=sys.stderr, flush=True)
                    result = run_client(
                        client, binary, backend, mode=mode, turns=args.turns, commits=scenario == "commits",
                        edits=scenario == "edits", turn_timeout=args.turn_timeout, log_dir=log_dir,
                        inject_text_replies=not args.policy_replies,
                    )  # fmt: skip
                    runs.append(result)
                    print("  " + report.row(result.to_json()), file=sys.stderr, flush=True)
    meta: dict[str, Any] = {
        "command": "python -m bench.clients " + " ".join(argv if argv is not None else sys.argv[1:]),
        "engine": args.engine,
        "model": model,
        "turns": args.turns,
        "date": stamp,
        "versions": versions,
        "logs": str(log_dir),
    }
    data = [r.to_json() for r in runs]
    table = report.markdown(meta, data, unavailable)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"clients-{args.engine}-{stamp}"
    base.with_suffix(".md").write_text(table)
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": data, "unavailable": unavailable}, indent=1))
    print(table)
    print(f"wrote {base}.md and .json; logs in {log_dir}", file=sys.stderr)
    if args.update_doc and not report.update_doc(table):
        print("docs/clients.md has no table markers: not updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
