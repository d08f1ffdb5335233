"""Does ``prefix-proxy analyze`` predict what the proxy then achieves? (docs/analysis.md)

1. The workload runs through the proxy with ``canon.mode: off`` and capture on (each scenario
   is an app: a tenant with its own API key), against a fresh fake vLLM backend.
2. ``analyze`` replays the capture through off, safe and relocate.
3. The same workload (same seed) runs through the proxy in safe and in relocate mode, each
   against a fresh backend: what the proxy achieves.

    python -m bench.analyze_accuracy [--sessions 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.analysis import MODES, captured_tally, read_capture, replay, to_json
from proxy.config import CanonMode, Settings, TenantSettings
from proxy.enginemodel import load_tokenizer
from testbed.demo import DEMO_MAX_MODEL_LEN
from testbed.serving import serve_in_thread
from testbed.workload import ScenarioResult, resolve_scenarios, run_workload_async


def api_key(scenario: str) -> str:
    return f"sk-{scenario}"


def run_mode(
    mode: CanonMode, scenarios: list[str], sessions: int, seed: int, capture: Path | None
) -> dict[str, ScenarioResult]:
    """The workload through a fresh proxy and backend; each scenario as its own tenant."""
    from proxy.app import create_app
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake_backend

    backend = create_fake_backend(FakeBackendConfig(max_model_len=DEMO_MAX_MODEL_LEN))
    with serve_in_thread(backend, name="fake") as backend_url:
        base = Settings(upstream=backend_url + "/v1")
        settings = base.model_copy(
            update={
                "canon": base.canon.model_copy(update={"mode": mode}),
                # analyze models canonicalization, not the repair of a sliding window (the default
                # repairs the workload's unnamed one): what it predicts is compared with that alone.
                "summarizer": base.summarizer.model_copy(update={"sliding_window_repair": "named"}),
                "tenants": [TenantSettings(name=s, api_key=api_key(s)) for s in scenarios],
                "capture": base.capture.model_copy(update={"path": str(capture) if capture else None}),
            }
        )
        with serve_in_thread(create_app(settings), name="proxy") as proxy_url:

            async def all_scenarios() -> list[dict[str, ScenarioResult]]:
                return await asyncio.gather(
                    *(
                        run_workload_async(
                            proxy_url + "/v1", [s], sessions_per_scenario=sessions, seed=seed, api_key=api_key(s)
                        )
                        for s in scenarios
                    )
                )

            results = asyncio.run(all_scenarios())
    return {name: result for part in results for name, result in part.items()}


def measure(sessions: int, seed: int, scenarios: list[str], workdir: Path) -> dict[str, Any]:
    capture = workdir / "capture.jsonl"
    achieved = {"off": run_mode("off", scenarios, sessions, seed, capture)}
    records = read_capture([capture])
    tokenizer = load_tokenizer(None)
    report = to_json([replay(records, mode, tokenizer) for mode in MODES], captured_tally(records), 16, tokenizer.name)
    for mode in ("safe", "relocate"):
        achieved[mode] = run_mode(mode, scenarios, sessions, seed, None)
    comparison: dict[str, Any] = {}
    for mode in MODES:
        prompt = sum(r.prompt_tokens for r in achieved[mode].values())
        cached = sum(r.cached_tokens for r in achieved[mode].values())
        predicted = report["modes"][mode]["hit_rate"]
        comparison[mode] = {
            "predicted_hit_rate": predicted,
            "achieved_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "points_off": round(100 * (predicted - cached / prompt), 2) if prompt else None,
            "per_app": {
                name: {
                    "predicted": report["apps"].get(f"{name}/fake-model", {}).get(mode, {}).get("hit_rate"),
                    "achieved": round(result.hit_rate, 4),
                }
                for name, result in achieved[mode].items()
            },
        }
    return {"requests": len(records), "comparison": comparison, "analyze": report}


def format_table(result: dict[str, Any]) -> str:
    comparison = result["comparison"]
    lines = [f"{result['requests']} captured requests (canon.mode off); hit rate predicted by analyze vs achieved", ""]
    lines.append(f"{'app':<18}" + "".join(f"{m + ' pred/ach':>22}" for m in MODES))
    for app in comparison["off"]["per_app"]:
        cells = ""
        for mode in MODES:
            entry = comparison[mode]["per_app"][app]
            predicted = "-" if entry["predicted"] is None else f"{entry['predicted']:.1%}"
            cells += f"{predicted + ' / ' + format(entry['achieved'], '.1%'):>22}"
        lines.append(f"{app:<18}{cells}")
    pairs = [f"{comparison[m]['predicted_hit_rate']:.1%} / {comparison[m]['achieved_hit_rate']:.1%}" for m in MODES]
    cells = "".join(f"{pair:>22}" for pair in pairs)
    lines.append(f"{'overall':<18}{cells}")
    lines.append(f"{'points off':<18}" + "".join(f"{comparison[m]['points_off']:>+22.2f}" for m in MODES))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analyze_accuracy", description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenarios", help="comma-separated (default: the default scenarios)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scenarios = [s.name for s in resolve_scenarios(args.scenarios)]
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(args.sessions, args.seed, scenarios, Path(workdir))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
