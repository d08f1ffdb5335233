"""The realistic client workload (testbed.workload) against arbitrary servers, or dumped as JSONL.

Compare a backend reached directly with the proxy in front of one (use two backends, or
reset the cache between the runs, so the second run does not reuse the first one's cache):

    python -m bench.workload --direct http://gpu:8000/v1 --proxied http://127.0.0.1:8080/v1 \\
        --reset-direct http://gpu:8000/reset_prefix_cache --reset-proxied http://gpu:8000/reset_prefix_cache

Or run it here, against fresh in-process fake vLLMs (one direct, one behind a prefix-proxy on its
defaults): small with ``--sessions 2``, full with the default 16 sessions per scenario:

    python -m bench.workload --in-process [--sessions 2] [--scenarios dify_rag,inline_query]

Beside direct and proxy prefill, each shape's *floor* (docs/canonicalization.md#the-floor): per
request, the tokens of the lines no earlier request of that shape carried (the model's replies
count as seen), and the ratios direct/floor and proxy/floor.

Dump the requests the workload sends, one JSON object per line (``scenario``, ``session``,
``step``, ``body``, ``prompt_tokens``, ``cached_tokens``), for other benchmarks to replay.
Assistant turns are the replies of the server the workload ran against: ``--base-url``, or
by default an in-process fake backend (no network):

    python -m bench.workload --dump requests.jsonl [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

from bench.floors import ShapeFloors
from proxy.progress import ProgressBar
from testbed.workload import Exchange, ScenarioResult, resolve_scenarios, run_workload_async, scenario_names
from testbed.workload.report import comparison_json, format_comparison


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "sessions_per_scenario": args.sessions,
        "seed": args.seed,
        "model": args.model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "api_key": args.api_key,
    }


async def _reset(url: str | None) -> None:
    if url:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(url)
            response.raise_for_status()


async def compare(args: argparse.Namespace) -> int:
    scenarios = [s.name for s in resolve_scenarios(args.scenarios)]
    bar = ProgressBar(sys.stderr)
    results: dict[str, dict[str, ScenarioResult] | None] = {"direct": None, "proxied": None}
    floors = ShapeFloors()
    for label, url, reset in (
        ("direct", args.direct, args.reset_direct),
        ("proxied", args.proxied, args.reset_proxied),
    ):
        if not url:
            continue
        await _reset(reset)
        # The floor is the client's: measured on the first run's requests (the same in both runs).
        measure = floors.observe if not floors.requests else None
        result = await run_workload_async(
            url, scenarios, progress=bar.start(label), on_exchange=measure, **_options(args)
        )
        bar.finish(sum(r.requests for r in result.values()))
        results[label] = result
    prefill = {label: {name: r.prefill_tokens for name, r in side.items()} for label, side in results.items() if side}
    if args.json:
        report = comparison_json(results["direct"], results["proxied"])
        report["floor"] = floors.to_json(prefill.get("direct"), prefill.get("proxied"))
        print(json.dumps(report, indent=2))
    else:
        print(format_comparison(results["direct"], results["proxied"]))
        print()
        print(floors.format_table(prefill.get("direct"), prefill.get("proxied")))
    errors = sum(r.errors for side in results.values() if side for r in side.values())
    return 1 if errors else 0


async def dump(args: argparse.Namespace, out: TextIO) -> int:
    transport: httpx.AsyncBaseTransport | None = None
    base_url = args.base_url
    if base_url is None:
        from testbed.fakevllm import FakeBackendConfig, create_app

        transport = httpx.ASGITransport(app=create_app(FakeBackendConfig()))
        base_url = "http://fake-backend/v1"

    def write(exchange: Exchange) -> None:
        record = {
            "scenario": exchange.scenario,
            "session": exchange.session_id,
            "step": exchange.step,
            "body": exchange.body,
            "status": exchange.status,
            "prompt_tokens": exchange.stat.prompt_tokens,
            "cached_tokens": exchange.stat.cached_tokens,
        }
        out.write(json.dumps(record, ensure_ascii=False) + "\n")

    results = await run_workload_async(
        base_url, args.scenarios, on_exchange=write, transport=transport, **_options(args)
    )
    errors = sum(r.errors for r in results.values())
    total = sum(r.requests for r in results.values())
    print(f"wrote {total} requests ({errors} errors)", file=sys.stderr)
    return 1 if errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.workload", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--direct", help="OpenAI base URL of a backend, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--proxied", help="OpenAI base URL of the proxy, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--reset-direct", help="URL to POST before the direct run (cache reset)")
    parser.add_argument("--reset-proxied", help="URL to POST before the proxied run (cache reset)")
    parser.add_argument("--dump", metavar="PATH", help="write the requests as JSONL ('-' for stdout)")
    parser.add_argument("--base-url", help="with --dump: server to run against (default: in-process fake)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--scenarios", help="comma-separated scenario names (default: all default ones)")
    parser.add_argument("--sessions", type=int, default=16, help="sessions per scenario (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model name (default: the first of GET /models)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--api-key")
    parser.add_argument("--json", action="store_true", help="machine-readable comparison")
    parser.add_argument(
        "--in-process", action="store_true", help="run against fresh in-process fake vLLMs, direct and via the proxy"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        from testbed.workload import get_scenario

        for name in scenario_names(include_all=True):
            print(f"{name:16} {get_scenario(name).description}")
        return 0
    if args.dump:
        if args.dump == "-":
            return asyncio.run(dump(args, sys.stdout))
        with open(args.dump, "w", encoding="utf-8") as out:
            return asyncio.run(dump(args, out))
    if args.in_process:
        return _in_process(args)
    if not (args.direct or args.proxied):
        parser.error("give --direct and/or --proxied, or --in-process (or --dump PATH, or --list)")
    return asyncio.run(compare(args))


def _in_process(args: argparse.Namespace) -> int:
    """Two fresh fake vLLMs in this process, one reached directly, one behind a prefix-proxy."""
    from contextlib import ExitStack

    from proxy.app import create_app
    from proxy.config import Settings
    from testbed.fakevllm import FakeBackendConfig
    from testbed.fakevllm import create_app as create_fake_backend
    from testbed.serving import serve_in_thread

    with ExitStack() as stack:
        direct = stack.enter_context(serve_in_thread(create_fake_backend(FakeBackendConfig()), name="fake-direct"))
        behind = stack.enter_context(serve_in_thread(create_fake_backend(FakeBackendConfig()), name="fake-proxied"))
        settings = Settings(upstream=behind + "/v1")
        proxy = stack.enter_context(serve_in_thread(create_app(settings), name="prefix-proxy"))
        args.direct, args.proxied = direct + "/v1", proxy + "/v1"
        args.reset_direct = args.reset_proxied = None
        return asyncio.run(compare(args))


if __name__ == "__main__":
    sys.exit(main())
