"""What routing over several backends does to the prefix-cache hit rate.

    python -m bench.routing [--backends 3] [--sessions 16] [--concurrency 8]

The project's workload goes through the proxy (default settings) to N fresh fake vLLM backends,
once per routing policy, and once more under ``affinity`` with one backend stopped halfway through.
A single backend carrying everything is the ceiling: no policy can beat one shared cache. Reported:
the hit rate the backends reported (usage), prefill tokens, the spread of requests over backends,
and failed requests.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from bench.routers import RouterRun, run_front, through_proxy


@dataclass
class RoutingRun(RouterRun):
    backends: int = 1


def run_policy(
    label: str,
    policy: str,
    backends: int,
    *,
    sessions: int,
    concurrency: int,
    seed: int,
    scenarios: Sequence[str] | None = None,
    lose_one_halfway: bool = False,
) -> RoutingRun:
    """The workload through the proxy routing by ``policy`` over ``backends`` fresh fake backends."""
    run = run_front(
        label,
        partial(through_proxy, routing={"policy": policy}),
        backends,
        sessions=sessions,
        concurrency=concurrency,
        seed=seed,
        scenarios=scenarios,
        lose_one_halfway=lose_one_halfway,
    )
    return RoutingRun(run.label, run.totals, run.per_backend, run.lost_backend, backends=backends)


def table(runs: list[RoutingRun]) -> str:
    ceiling = runs[0]
    lines = [
        "| routing | backends | requests (errors) | hit rate | prefill tokens | vs one backend "
        "| requests per backend |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {' | '.join([run.label, str(run.backends), *run.cells(ceiling.totals)])} |" for run in runs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=16, help="sessions per scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    options = {"sessions": args.sessions, "concurrency": args.concurrency, "seed": args.seed}
    runs = [run_policy("one backend (ceiling)", "affinity", 1, **options)]
    for policy in ("affinity", "least_in_flight", "round_robin"):
        runs.append(run_policy(policy, policy, args.backends, **options))
    runs.append(
        run_policy("affinity, one backend lost halfway", "affinity", args.backends, lose_one_halfway=True, **options)
    )
    print(table(runs))
    return 1 if any(run.failed(args.concurrency) for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
