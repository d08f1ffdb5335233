"""Why requests miss, per workload scenario, before (canon.mode off) and after canonicalization.

Each scenario runs alone against a fresh fake vLLM backend behind a fresh proxy (in this
process), once per mode; the proxy's own counters (``prefix_proxy_cache_breaks_total``,
``prefix_proxy_cache_break_tokens_total``) give requests and tokens lost by cause:

    python -m bench.cache_breaks [--sessions 8] [--modes off,relocate] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from proxy.config import CanonMode, Settings
from proxy.observability import CAUSES
from testbed.demo import DEMO_MAX_MODEL_LEN
from testbed.serving import serve_in_thread
from testbed.workload import resolve_scenarios, run_workload

Breakdown = dict[str, dict[str, int]]  # cause -> {"requests": n, "tokens": n}


def _counter(metrics: Any, name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["cause"]] = sample.value
    return values


def run_scenario(scenario: str, mode: CanonMode, sessions: int, seed: int) -> dict[str, Any]:
    from proxy.app import create_app
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake_backend

    backend = create_fake_backend(FakeBackendConfig(max_model_len=DEMO_MAX_MODEL_LEN))
    with serve_in_thread(backend, name="fake") as backend_url:
        settings = Settings(upstream=backend_url + "/v1")
        settings = settings.model_copy(update={"canon": settings.canon.model_copy(update={"mode": mode})})
        app = create_app(settings)
        with serve_in_thread(app, name="proxy") as proxy_url:
            result = run_workload(proxy_url + "/v1", [scenario], sessions_per_scenario=sessions, seed=seed)[scenario]
    metrics = app.state.proxy.metrics
    requests = _counter(metrics, "prefix_proxy_cache_breaks_total")
    tokens = _counter(metrics, "prefix_proxy_cache_break_tokens_total")
    causes = {
        cause: {"requests": int(requests.get(cause, 0)), "tokens": int(tokens.get(cause, 0))}
        for cause in CAUSES
        if requests.get(cause)
    }
    return {
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "prefill_tokens": result.prefill_tokens,
        "hit_rate": round(result.hit_rate, 4),
        "causes": causes,
    }


def format_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Per scenario and mode: hit rate, prefill, and the causes with their estimated tokens lost."""
    lines = [f"{'scenario':<17} {'mode':<9} {'hit':>6} {'prefill':>9}  causes (requests / est. tokens lost)"]
    for scenario, modes in results.items():
        for mode, row in modes.items():
            causes = sorted(row["causes"].items(), key=lambda item: -item[1]["tokens"])
            text = ", ".join(f"{c} {v['requests']}/{v['tokens']:,}" for c, v in causes) or "-"
            lines.append(f"{scenario:<17} {mode:<9} {row['hit_rate']:>6.1%} {row['prefill_tokens']:>9,}  {text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_breaks", description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenarios", help="comma-separated (default: the default scenarios)")
    parser.add_argument("--modes", default="off,relocate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = [s.name for s in resolve_scenarios(args.scenarios)]
    modes: list[CanonMode] = [m for m in ("off", "safe", "relocate") if m in args.modes.split(",")]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        results[name] = {}
        for mode in modes:
            results[name][mode] = run_scenario(name, mode, args.sessions, args.seed)
            print(f"{name} {mode} done", file=sys.stderr)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
