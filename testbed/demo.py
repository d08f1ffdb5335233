"""``prefix-proxy demo``: what the proxy does for real client traffic, with nothing to set up.

Starts, in this process, two fresh fake vLLM backends (independent prefix caches) and the
proxy (its default config) in
front of the second one, runs the same workload directly against the first backend and
through the proxy, and prints prompt tokens, cached tokens,
hit rate and prefill tokens per scenario, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from proxy.cli import DEMO_CONCURRENCY, DEMO_SEED, DEMO_SESSIONS, add_demo_arguments
from proxy.progress import ProgressBar

if TYPE_CHECKING:
    from proxy.config import Settings
    from testbed.workload import ScenarioResult


@dataclass
class DemoResult:
    direct: dict[str, ScenarioResult]
    proxied: dict[str, ScenarioResult]
    sessions: int
    seed: int
    block_size: int
    scenarios: list[str]
    wall_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.direct.values()) + sum(r.errors for r in self.proxied.values())

    def to_json(self) -> dict[str, Any]:
        from testbed.workload.report import comparison_json

        return {
            "sessions_per_scenario": self.sessions,
            "seed": self.seed,
            "block_size": self.block_size,
            "scenarios": list(self.scenarios),
            "wall_s": round(self.wall_s, 2),
            "phase_s": {k: round(v, 2) for k, v in self.phase_s.items()},
            **comparison_json(self.direct, self.proxied),
        }

    def format_table(self) -> str:
        from testbed.workload.report import format_comparison

        title = (
            f"prefix-proxy demo: {self.sessions} sessions per scenario, seed {self.seed}, "
            f"fake vLLM backends ({DEMO_MAX_MODEL_LEN // 1024}k context, {self.block_size}-token blocks), "
            "proxy with its default config"
        )
        return f"{title}\n\n{format_comparison(self.direct, self.proxied)}"


# A 16k-context model: the long session passes its soft threshold, so the summarizer is seen at work.
DEMO_MAX_MODEL_LEN = 16384


def run_demo(
    *,
    sessions: int = DEMO_SESSIONS,
    seed: int = DEMO_SEED,
    scenarios: Sequence[str] | str | None = None,
    block_size: int = 16,
    concurrency: int = DEMO_CONCURRENCY,
    progress: bool = True,
    progress_stream: TextIO | None = None,
    settings: Settings | None = None,
) -> DemoResult:
    """Run the workload directly and through the proxy against fresh fake backends.

    ``settings`` is the proxy's :class:`proxy.config.Settings` (its ``upstream`` is replaced);
    by default ``Settings()``, i.e. defaults plus any ``PREFIX_PROXY_*`` environment.
    """
    from proxy.app import create_app
    from proxy.config import Settings
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake_backend
    from testbed.serving import serve_in_thread
    from testbed.workload import resolve_scenarios, run_workload

    names = [s.name for s in resolve_scenarios(scenarios)]
    bar = ProgressBar(progress_stream) if progress else None
    started = time.monotonic()
    phase_s: dict[str, float] = {}
    results: dict[str, dict[str, ScenarioResult]] = {}
    backend_config = FakeBackendConfig(block_size=block_size, max_model_len=DEMO_MAX_MODEL_LEN)
    with ExitStack() as stack:
        direct_url = stack.enter_context(serve_in_thread(create_fake_backend(backend_config), name="fake-direct"))
        backend_url = stack.enter_context(serve_in_thread(create_fake_backend(backend_config), name="fake-proxied"))
        if settings is None:
            settings = Settings()
        base = settings
        proxy_settings = base.model_copy(update={"upstream": backend_url + "/v1"})
        proxy_url = stack.enter_context(serve_in_thread(create_app(proxy_settings), name="prefix-proxy"))
        for label, url in (("direct", direct_url), ("proxied", proxy_url)):
            phase_started = time.monotonic()
            callback = bar.start(label) if bar is not None else None
            result = run_workload(
                url + "/v1",
                names,
                sessions_per_scenario=sessions,
                seed=seed,
                progress=callback,
                concurrency=concurrency,
            )
            results[label] = result
            phase_s[label] = time.monotonic() - phase_started
            if bar is not None:
                bar.finish(sum(r.requests for r in result.values()))
    return DemoResult(
        direct=results["direct"],
        proxied=results["proxied"],
        sessions=sessions,
        seed=seed,
        block_size=block_size,
        scenarios=names,
        wall_s=time.monotonic() - started,
        phase_s=phase_s,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``proxy.cli.add_demo_arguments`` options; prints the result, returns the exit code."""
    if args.list:
        from testbed.workload.registry import get_scenario, scenario_names

        defaults = set(scenario_names())
        for name in scenario_names(include_all=True):
            print(f"{'*' if name in defaults else ' '} {name}: {get_scenario(name).description}")
        return 0
    if args.sessions < 1 or args.block_size < 1 or args.concurrency < 1:
        print("--sessions, --block-size and --concurrency must be positive", file=sys.stderr)
        return 2
    try:
        result = run_demo(
            sessions=args.sessions,
            seed=args.seed,
            scenarios=args.scenarios,
            block_size=args.block_size,
            concurrency=args.concurrency,
            progress=not args.no_progress,
        )
    except KeyError as exc:  # unknown scenario name
        print(exc.args[0] if exc.args else str(exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.format_table())
    if result.errors:
        print(f"{result.errors} request(s) failed", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefix-proxy demo", description=__doc__)
    add_demo_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
