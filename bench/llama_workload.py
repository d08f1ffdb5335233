"""The project's workload on llama-server: direct, through the proxy, and the floor, per shape.

    python -m bench.llama_workload [--cache DIR] [--scenarios a,b] [--sessions 4] [--ctx-size 8192 --parallel 4]

The scenarios of ``testbed.workload`` (``python -m bench.workload --list``) sent to a fresh llama-server
(built and fetched by ``bench.llama_server``), then to another fresh one through a real ``prefix-proxy
serve`` on its defaults. Prefill per pass is what llama-server computed: ``prompt_tokens - cached_tokens``
of each answer (its ``usage.prompt_tokens_details.cached_tokens``), and beside it its own
``llamacpp:prompt_tokens_total`` (which also counts the proxy's summary requests).

And per pass, from llama-server's own log (``--log-file``), how it placed requests in its slots:
requests that named a slot (``id_slot``), that took the free slot sharing the most with them, and
that took the least recently used one *holding another prompt*, whose conversation they evicted
(``server-context.cpp`` ``get_available_slot``: "selected slot by id / by LCP similarity / by LRU").

The floor (docs/engines.md, DESIGN "The floor"): per request, the tokens of the lines no earlier request
of its shape carried (assistant lines count as seen: the engine generated them), computed from the
requests the direct pass answered, at each request's own tokens per byte: ``bench.floors.ShapeFloors``,
the measure ``bench.workload`` and ``prefix-proxy analyze`` report.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.floors import ShapeFloors
from bench.llama_server import (
    DEFAULT_CACHE,
    MODEL_NAME,
    _engine_prompt_tokens,
    ensure_engine,
    ensure_model,
    llama_server,
)
from bench.servers import proxy
from testbed.workload import Exchange, run_workload_async

# llama-server's log line when a request gets a slot: "selected slot by id (N)", "by LCP similarity,
# ...", "by LRU, t_last = T" (T = -1: the slot never held a prompt).
_SELECTED = re.compile(r"selected slot by (id|LCP similarity|LRU)(?:, t_last = (-?\d+))?")


@dataclass
class SlotPicks:
    """How llama-server placed one pass's requests in its slots (from its log)."""

    named: int = 0
    similar: int = 0
    fresh: int = 0  # the least recently used slot, never used before
    evicting: int = 0  # the least recently used slot, holding another prompt

    @classmethod
    def read(cls, log: Path) -> SlotPicks:
        picks = cls()
        text = log.read_text(errors="replace") if log.exists() else ""
        for how, t_last in _SELECTED.findall(text):
            if how == "id":
                picks.named += 1
            elif how == "LCP similarity":
                picks.similar += 1
            elif t_last == "-1":
                picks.fresh += 1
            else:
                picks.evicting += 1
        return picks


DEFAULT_SCENARIOS = "dify_rag,timestamp_user,open_webui,stable_app,append_only"


@dataclass
class Row:
    requests: int = 0
    errors: int = 0
    prefill: int = 0
    floor: int = 0


def run(
    base: str, scenarios: list[str], sessions: int, max_tokens: int, model: str | None = MODEL_NAME
) -> tuple[dict[str, Row], ShapeFloors]:
    exchanges: list[Exchange] = []
    asyncio.run(
        run_workload_async(
            base,
            scenarios,
            sessions_per_scenario=sessions,
            model=model,
            concurrency=4,
            max_tokens=max_tokens,
            on_exchange=exchanges.append,
        )
    )
    rows: dict[str, Row] = {}
    floors = ShapeFloors()
    for exchange in exchanges:
        row = rows.setdefault(exchange.scenario, Row())
        row.requests += 1
        if exchange.status != 200:
            row.errors += 1
            continue
        row.prefill += exchange.stat.prompt_tokens - exchange.stat.cached_tokens
        floors.observe(exchange)
    return rows, floors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--ctx-size", type=int, default=8192)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--proxy-log", type=Path, help="the proxy's log (one line per request) to this file")
    args = parser.parse_args(argv)
    binary, model = ensure_engine(args.cache), ensure_model(args.cache)
    scenarios = args.scenarios.split(",")
    totals = {}
    logs = Path(tempfile.mkdtemp(prefix="llama-workload-"))
    direct_log, proxy_log = logs / "direct.log", logs / "proxy.log"
    with llama_server(binary, model, args.ctx_size, args.parallel, ["--log-file", str(direct_log)]) as server:
        direct, floors = run(server + "/v1", scenarios, args.sessions, args.max_tokens)
        totals["direct"] = _engine_prompt_tokens(server)
    log = args.proxy_log.open("wb") if args.proxy_log else subprocess.DEVNULL
    with (
        llama_server(binary, model, args.ctx_size, args.parallel, ["--log-file", str(proxy_log)]) as server,
        proxy(server + "/v1", stderr=log) as base,
    ):
        proxied, _ = run(base, scenarios, args.sessions, args.max_tokens)
        totals["proxy"] = _engine_prompt_tokens(server)
    for name, floor in floors.tokens.items():
        direct[name].floor = floor
    print(
        f"llama-server --ctx-size {args.ctx_size} --parallel {args.parallel}, {MODEL_NAME}, "
        f"{args.sessions} sessions each:"
    )
    print(
        f"  {'scenario':18} {'requests':>8} {'errors d/p':>10} {'direct':>9} {'proxy':>9} {'floor':>8} "
        f"{'proxy/direct':>12}"
    )
    for name in scenarios:
        d, p = direct.get(name, Row()), proxied.get(name, Row())
        ratio = p.prefill / d.prefill if d.prefill else 0.0
        print(
            f"  {name:18} {d.requests:8} {d.errors:4}/{p.errors:<5} {d.prefill:9,} {p.prefill:9,} {d.floor:8,} "
            f"{ratio:12.2f}"
        )
    print(f"  llamacpp:prompt_tokens_total: direct {totals['direct']:,.0f}, proxy {totals['proxy']:,.0f}")
    print(f"  slots taken (llama-server's log, {logs}): named / most similar / unused / evicting another prompt")
    for name, path in (("direct", direct_log), ("proxy", proxy_log)):
        picks = SlotPicks.read(path)
        print(f"    {name:7} {picks.named:5} / {picks.similar:5} / {picks.fresh:5} / {picks.evicting:5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
