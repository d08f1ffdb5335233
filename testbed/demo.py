"""``prefix-proxy demo``: what the proxy does for real client traffic, with nothing to set up.

Starts, in this process, two fresh fake vLLM backends (independent prefix caches) and the
proxy (its default config) in
front of the second one, runs the same workload directly against the first backend and
through the proxy, and prints prompt tokens, cached tokens,
hit rate and prefill tokens per scenario, side by side; then what the figure means, why the pass
through the proxy takes longer here (the CPU time of each part, measured per thread: everything
shares one process), and the command to put the proxy in front of a real backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from proxy.cli import DEMO_CONCURRENCY, DEMO_SEED, DEMO_SESSIONS, add_demo_arguments
from proxy.progress import ProgressBar

if TYPE_CHECKING:
    from proxy.config import Settings
from testbed.reference import PREFILL_TOKENS_PER_S, REFERENCE_GPU, gpu_ms
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
    # CPU seconds of each part (PARTS) during each phase; empty where threads' CPU cannot be read.
    phase_cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)

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
            "phase_cpu_s": {k: {p: round(s, 2) for p, s in v.items()} for k, v in self.phase_cpu_s.items()},
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

    def format_summary(self) -> str:
        """What the table says, why the proxied pass took longer, and what to run next."""
        from testbed.workload.runner import overall

        direct, proxied = overall(self.direct.values()), overall(self.proxied.values())
        saved = 1 - proxied.prefill_tokens / direct.prefill_tokens if direct.prefill_tokens else 0.0
        untouched = [
            name
            for name in self.scenarios
            if name in self.direct
            and name in self.proxied
            and self.proxied[name].prefill_tokens >= self.direct[name].prefill_tokens
        ]
        lines = [
            f"What the figure means: for the same {proxied.requests:,} requests, the backend behind the proxy "
            f"computed {proxied.prefill_tokens:,} prompt tokens instead of {direct.prefill_tokens:,} "
            f"({100 * saved:.1f}% less prefill), because its prefix cache served {100 * proxied.hit_rate:.1f}% "
            f"of the prompt tokens instead of {100 * direct.hit_rate:.1f}%. Prefill is the GPU's work before "
            "the first token: on a real vLLM, less of it means a shorter time to first token and more requests "
            "per GPU.",
        ]
        if untouched:
            lines.append(
                f"A scenario at 0.0% saved ({', '.join(untouched)}) is one the proxy left as it was: already "
                "cache-friendly, or nothing in it the proxy may safely move."
            )
        lines += ["", *self._timing_lines(), "", *NEXT_STEPS]
        # Paragraphs wrapped for a terminal; the indented lines (figures, the command) as they are.
        return "\n".join(
            line if line.startswith(" ") else textwrap.fill(line, SUMMARY_WIDTH, break_on_hyphens=False)
            for line in lines
        )

    def _timing_lines(self) -> list[str]:
        direct_s, proxied_s = self.phase_s.get("direct", 0.0), self.phase_s.get("proxied", 0.0)
        why = "Why the second is longer: this" if proxied_s > direct_s else "This"
        lines = [
            f"Time: direct {direct_s:.1f} s, through the proxy {proxied_s:.1f} s. {why} demo runs the clients, "
            "the fake backends and the proxy in one Python process, which runs Python code one thread at a "
            "time, so a pass lasts about as long as all the CPU work in it, the proxy's included. Nothing in it "
            "waits on a GPU: the fake backend answers without a model, in a few milliseconds.",
        ]
        cpu = {phase: self.phase_cpu_s.get(phase, {}) for phase in ("direct", "proxied")}
        requests = sum(r.requests for r in self.proxied.values())
        if not (cpu["direct"] and cpu["proxied"] and requests):
            return lines
        lines.append("CPU time in this process, per part:")
        for phase, label in (("direct", "direct"), ("proxied", "through the proxy")):
            parts = ", ".join(f"{part} {cpu[phase][part]:.1f} s" for part in PARTS if cpu[phase].get(part, 0.0) >= 0.05)
            lines.append(f"  {label + ':':<19}{parts}; {sum(cpu[phase].values()):.1f} s in all")
        own = cpu["proxied"].get(PROXY, 0.0)
        extra = sum(cpu["proxied"].values()) - sum(cpu["direct"].values())
        share = f", {100 * own / extra:.0f}% of the extra CPU time" if extra > own > 0 else ""
        saved = sum(self.direct[name].prefill_tokens - self.proxied[name].prefill_tokens for name in self.proxied)
        saved_per_request = saved / requests
        lines.append(
            f"The proxy's own CPU is {own:.1f} s, {1000 * own / requests:.1f} ms a request (reading the request, "
            "canonicalizing, sessions, relaying the answer): "
            f"{100 * own / sum(cpu['proxied'].values()):.0f}% of the pass through the proxy{share}. That is a "
            "large share only because the fake backend computes no model. Against what it saves: "
            f"{saved_per_request:,.0f} prompt tokens of prefill a request, {gpu_ms(saved_per_request):.1f} ms of "
            f"GPU time a request on {REFERENCE_GPU} (about {PREFILL_TOKENS_PER_S:,} prompt tokens/s; "
            "testbed/reference.py says where that figure comes from). In front of vLLM the proxy runs in a "
            "process of its own, and its milliseconds sit beside the model's prefill and decoding. Every "
            "response reports them (x-prefix-proxy-overhead-ms), and so does /metrics "
            "(prefix_proxy_overhead_seconds)."
        )
        busy = max(self.phase_s.get(phase, 0.0) - sum(cpu[phase].values()) for phase in cpu)
        if busy > 0.25 * max(direct_s, proxied_s, 1e-9):
            lines.append(
                f"(This process waited {busy:.1f} s for a core in a pass: other programs were using the machine, "
                "so the wall times above are longer than its CPU time.)"
            )
        return lines


SUMMARY_WIDTH = 100
# The parts whose CPU time the demo reports, by the thread they run on.
PROXY = "proxy"
PARTS = ("fake backend", "clients", PROXY, "other")
NEXT_STEPS = (
    "Next: the proxy in front of your vLLM (started with --enable-prefix-caching",
    "--enable-prompt-tokens-details), your OpenAI clients pointed at http://127.0.0.1:8080/v1:",
    "  prefix-proxy serve --upstream http://127.0.0.1:8000/v1 --port 8080",
)


def thread_cpu_s(clients: threading.Thread) -> dict[str, float]:
    """CPU seconds each part of the demo (PARTS) has used so far, from the kernel's per-thread counters
    (Linux); empty elsewhere. The servers run on the threads serve_in_thread names, the clients on
    ``clients``; anything else (executors) is "other"."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return {}
        if thread is clients:
            part = "clients"
        elif thread.name == "prefix-proxy":
            part = PROXY
        elif thread.name.startswith("fake-"):
            part = "fake backend"
        else:
            part = "other"
        # utime and stime: fields 14 and 15 of the line, 12 and 13 after the command's name
        used[part] = used.get(part, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return used


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
    phase_cpu_s: dict[str, dict[str, float]] = {}
    clients = threading.current_thread()
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
            cpu_before = thread_cpu_s(clients)
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
            cpu_after = thread_cpu_s(clients)
            if cpu_before and cpu_after:
                phase_cpu_s[label] = {
                    part: max(0.0, used - cpu_before.get(part, 0.0)) for part, used in cpu_after.items()
                }
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
        phase_cpu_s=phase_cpu_s,
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
        print()
        print(result.format_summary())
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
