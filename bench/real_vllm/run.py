"""The proxy on a real vLLM: the project's workload direct and through the proxy, and the fake's prediction.

    python -m bench.real_vllm.run [--sessions 4] [--scenarios dify_rag,fc_agent] [--preset small]

1. Sets the engine up if needed (`bench/real_vllm/setup.py`, idempotent: ~3.5 min the first time).
2. Real vLLM (`RealVLLM`: CPU build, random-weight model, replies forced to the fake's reply policy)
   with the proxy (default settings, in-process) in front: scenario by scenario, direct then through
   the proxy, the same sessions, streaming (time to first token), vLLM's /metrics read around each.
3. The prediction: the fake backend (in-process) with the engine's own tokenizer, block size, context
   length and KV pool size, the proxy (default settings) in front, the same sessions, same order.
4. Writes `bench/results/real_vllm-<time>.md` and `.json` (and `real_vllm-latest.*`), prints the
   markdown, stops everything it started.

Runs are kept apart by `cache_salt` (distinct per run and side; see `bench/real_vllm/compare.py`).
Exit status: 0, 1 when requests failed, 2 when the engine is unavailable, 3 with --strict when a
target is not met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.real_vllm.compare import PhaseSpec, ScenarioRun, Workload, compare, play
from bench.real_vllm.engine import REPO_ROOT, RealVLLM, unavailable_reason
from bench.real_vllm.report import markdown
from bench.real_vllm.streaming import TimedStat

# The model shape (~57M parameters): prefill dominates its time to first token, as it does
# for real models on real prompts. On "tiny" (13M, the tests' engine) a fixed ~14 ms per request
# weighs as much as 60 computed tokens, which flattens TTFT ratios of short prompts.
BENCH_PRESET = "small"
DEFAULT_SCENARIOS = ("dify_rag", "timestamp_user", "fc_agent", "inline_query", "stable_app")
RESULTS_DIR = REPO_ROOT / "bench" / "results"


_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def run_fake(
    workload: Workload,
    model_dir: Path,
    block_size: int,
    max_model_len: int,
    run_id: str,
    log: Callable[[str], None] | None = _log,
    capacity_blocks: int | None = None,
) -> tuple[dict[str, ScenarioRun], dict[str, ScenarioRun]]:
    """The fake backend's prediction: same sessions, the engine's tokenizer, block size and context
    length (and KV pool size, ``capacity_blocks``, when known: it decides LRU eviction)."""
    from proxy.app import create_app
    from proxy.config import Settings
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake
    from testbed.serving import serve_in_thread

    config = FakeBackendConfig(
        model=workload.model,
        block_size=block_size,
        tokenizer_path=str(model_dir / "tokenizer.json"),
        max_model_len=max_model_len,
    )
    if capacity_blocks:
        config.cache_capacity_blocks = capacity_blocks
    with ExitStack() as stack:
        fake = stack.enter_context(serve_in_thread(create_fake(config), name="fake-vllm"))
        proxy = stack.enter_context(
            serve_in_thread(create_app(Settings(upstream=fake + "/v1")), name="prefix-proxy-fake")
        )
        specs = [
            PhaseSpec("fake direct", fake + "/v1", fake + "/metrics", f"fake-direct-{run_id}"),
            PhaseSpec("fake proxied", proxy + "/v1", fake + "/metrics", f"fake-proxied-{run_id}"),
        ]
        runs = asyncio.run(play(specs, workload, log=log))
    return runs["fake direct"], runs["fake proxied"]


def kv_cache_tokens(log_path: Path) -> int | None:
    """The KV pool size vLLM logged at start-up ("CPU KV cache size: 349,504 tokens")."""
    try:
        match = re.search(r"KV cache size: ([\d,]+) tokens", log_path.read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1).replace(",", "")) if match else None


def warm_up(engine: RealVLLM, proxy_url: str, run_id: str) -> None:
    """One short request each way, so first-request costs are not in the first measured TTFT."""
    body = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "Warm-up: say something short."}],
        "max_tokens": 4,
        "cache_salt": f"warmup-{run_id}",
    }
    for url in (engine.openai_base_url, proxy_url + "/v1"):
        httpx.post(url + "/chat/completions", json=body, timeout=300).raise_for_status()


def run_real(workload: Workload, preset: str, run_id: str, startup_timeout: float):
    from proxy.app import create_app
    from proxy.config import Settings
    from testbed.serving import serve_in_thread

    info: dict[str, Any] = {}
    with ExitStack() as stack:
        _log(f"starting vLLM ({preset}) ...")
        engine = stack.enter_context(RealVLLM(preset=preset, startup_timeout=startup_timeout))
        info.update(
            startup_s=engine.startup_seconds,
            block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            server_log=str(engine.log_path),
            command=" ".join(engine.command()),
        )
        try:
            info["vllm_version"] = httpx.get(engine.base_url + "/version", timeout=10).json().get("version")
        except (httpx.HTTPError, ValueError):
            info["vllm_version"] = None
        info["kv_cache_tokens"] = kv_cache_tokens(engine.log_path)
        _log(f"vLLM {info['vllm_version']} healthy after {engine.startup_seconds:.1f}s at {engine.base_url}")
        proxy = stack.enter_context(
            serve_in_thread(create_app(Settings(upstream=engine.openai_base_url)), name="prefix-proxy")
        )
        warm_up(engine, proxy, run_id)
        metrics = engine.base_url + "/metrics"
        specs = [
            PhaseSpec("direct", engine.openai_base_url, metrics, f"direct-{run_id}"),
            PhaseSpec("proxied", proxy + "/v1", metrics, f"proxied-{run_id}"),
        ]
        started = time.monotonic()
        runs = asyncio.run(play(specs, workload, log=_log))
        info["measure_s"] = time.monotonic() - started
        _log("stopping vLLM")
    return runs["direct"], runs["proxied"], info


def per_request(label: str, runs: dict[str, ScenarioRun]) -> list[dict[str, Any]]:
    out = []
    for scenario, run in runs.items():
        for stat in run.result.per_request:
            item = {"side": label, "scenario": scenario, **asdict(stat)}
            item["actions"] = list(stat.actions)
            out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_vllm.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4, help="sessions per scenario (default %(default)s)")
    parser.add_argument(
        "--scenarios", default=",".join(DEFAULT_SCENARIOS), help="comma-separated scenario names (default: %(default)s)"
    )
    parser.add_argument("--preset", default=BENCH_PRESET, help="tiny, small or micro (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="per request (default 32: the forced tool calls fit in 31)"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1: clean TTFT)")
    parser.add_argument("--max-user-turns", type=int, default=None, help="cut every session to this many user turns")
    parser.add_argument("--no-fake", action="store_true", help="skip the fake backend's prediction")
    parser.add_argument("--no-install", action="store_true", help="fail instead of running bench/real_vllm/setup.py")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--strict", action="store_true", help="exit 3 when a target is not met")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the engine and the in-process servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from testbed.workload import resolve_scenarios

    try:
        scenarios = [s.name for s in resolve_scenarios(args.scenarios)]
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    workload = Workload(
        scenarios=scenarios,
        sessions=args.sessions,
        seed=args.seed,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        max_user_turns=args.max_user_turns,
    )
    t0 = time.monotonic()
    started = datetime.now(UTC)
    _log("checking the engine install (bench/real_vllm/setup.py) ...")
    why = unavailable_reason(install=not args.no_install, preset=args.preset)
    if why:
        print(f"real vLLM unavailable: {why}", file=sys.stderr)
        return 2
    run_id = secrets.token_hex(6)
    probe = RealVLLM(preset=args.preset)  # not started: its settings and model folder
    fake_direct = fake_proxied = None
    timings: dict[str, float] = {"setup_s": time.monotonic() - t0}
    t = time.monotonic()
    direct, proxied, info = run_real(workload, args.preset, run_id, args.startup_timeout)
    timings["vllm_total_s"] = time.monotonic() - t
    timings["vllm_startup_s"] = info.pop("startup_s") or 0.0
    timings["vllm_measure_s"] = info.pop("measure_s")
    if not args.no_fake:
        _log("fake backend (the engine's tokenizer, block size and KV pool) direct and through the proxy ...")
        t = time.monotonic()
        capacity = info["kv_cache_tokens"] // probe.block_size if info.get("kv_cache_tokens") else None
        fake_direct, fake_proxied = run_fake(
            workload, probe.model_dir, probe.block_size, probe.max_model_len, run_id, capacity_blocks=capacity
        )
        timings["fake_s"] = time.monotonic() - t
    timings["wall_s"] = time.monotonic() - t0

    result = compare(direct, proxied, fake_direct, fake_proxied)
    config = {
        "preset": args.preset,
        "sessions": args.sessions,
        "seed": args.seed,
        "scenarios": scenarios,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "max_user_turns": args.max_user_turns,
        "isolation": "cache_salt per run and side",
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "startup_s": timings["vllm_startup_s"],
        "wall_s": timings["wall_s"],
        "run_id": run_id,
        **info,
    }
    text = markdown(result, config)
    record = {"config": config, "timings": timings, **result, "requests": []}
    for label, runs in (("direct", direct), ("proxied", proxied), ("fake direct", fake_direct or {}),
                        ("fake proxied", fake_proxied or {})):  # fmt: skip
        record["requests"] += per_request(label, runs)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"real_vllm-{started.strftime('%Y%m%d-%H%M%S')}"
    for name in (stem, "real_vllm-latest"):
        (args.out_dir / f"{name}.md").write_text(text)
        (args.out_dir / f"{name}.json").write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    print(text)
    _log(f"wrote {args.out_dir / stem}.md and .json")

    if result["targets"]["no_errors"]["errors"]:
        return 1
    if args.strict and not all(t.get("met", True) for t in result["targets"].values()):
        return 3
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, TimedStat):
        return asdict(value)
    if isinstance(value, float | int):
        return value
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
