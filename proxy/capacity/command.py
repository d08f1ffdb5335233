"""``prefix-proxy ramp`` and the capacity side of ``prefix-proxy kv``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from proxy.capacity.knee import Knee, find_knee
from proxy.capacity.pool import GIB, KVPool, describe_pool, pool_from_memory
from proxy.capacity.vllm_metrics import has_engine_signals, pool_from_metrics


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


# -- kv ----------------------------------------------------------------------------------------


def add_kv_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("capacity (how many tokens the KV pool holds)")
    group.add_argument("--gpu-memory-gib", type=float, help="memory of the GPU(s) one vLLM instance uses")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's flag (default 0.9)")
    group.add_argument("--weights-gib", type=float, default=0.0, help="model weights (e.g. 15 for 8B in bf16)")
    group.add_argument(
        "--activation-gib", type=float, default=0.0, help="peak activations vLLM profiles (its log says; ~1-3)"
    )
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--concurrency", type=int_list, default=[1, 8, 32, 64], help="e.g. 1,8,32")
    group.add_argument("--output-length", type=int, default=0, help="output tokens each sequence also holds")


def kv_capacity(args: argparse.Namespace, bytes_per_token: int) -> str | None:
    if args.gpu_memory_gib is None:
        return None
    pool = pool_from_memory(
        args.gpu_memory_gib * GIB,
        bytes_per_token,
        utilization=args.gpu_memory_utilization,
        weights_bytes=args.weights_gib * GIB,
        activation_bytes=args.activation_gib * GIB,
        block_size=args.block_size,
    )
    return describe_pool(pool, bytes_per_token, args.concurrency, args.output_length)


# -- ramp --------------------------------------------------------------------------------------


def add_ramp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, help="the backend's OpenAI base URL, e.g. http://vllm:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int_list, default=[1, 4], help="comma-separated (default 1,4)")
    parser.add_argument(
        "--input-lengths",
        type=int_list,
        default=[256, 512, 1024, 2048, 4096, 8192],
        help="prompt tokens per step, comma-separated",
    )
    parser.add_argument("--output-length", type=int, default=64, help="max_tokens per request (default 64)")
    parser.add_argument("--ignore-eos", action="store_true", help="vLLM's ignore_eos: every reply is that long")
    parser.add_argument("--api-key")
    parser.add_argument(
        "--kv-blocks", type=int, help="KV pool size for the prediction (default: vLLM's cache_config_info)"
    )
    parser.add_argument("--block-size", type=int, help="with --kv-blocks (default: vLLM's, else 16)")
    parser.add_argument("--plot", default="ramp.svg", help="SVG chart to write (default ramp.svg; '' for none)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def run_ramp_command(args: argparse.Namespace) -> int:
    from proxy.capacity.plot import render_svg
    from proxy.capacity.ramp import RampConfig, run_ramp
    from proxy.progress import ProgressBar

    config = RampConfig(
        upstream=args.upstream,
        model=args.model,
        concurrencies=args.concurrency,
        input_lengths=args.input_lengths,
        output_tokens=args.output_length,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
    )
    bar = None if args.no_progress else ProgressBar()
    callback = bar.start("ramp") if bar is not None else None
    try:
        run = asyncio.run(run_ramp(config, callback))
    except (RuntimeError, OSError) as error:
        print(f"ramp failed: {error}", file=sys.stderr)
        return 1
    if bar is not None:
        bar.finish(len(run.steps))
    pool = _pool(args, run.metrics_text)
    engine_signals = has_engine_signals(run.metrics_text)
    knees = [find_knee([s for s in run.steps if s.concurrency == c], engine_signals) for c in config.concurrencies]
    predicted = {c: pool.max_context(c, config.output_tokens) for c in config.concurrencies} if pool else {}
    report = ramp_report(run.steps, knees, pool, predicted)
    if args.plot:
        title = f"{args.model}: ramp of input length" + (f", KV pool {pool.tokens:,} tokens" if pool else "")
        Path(args.plot).write_text(render_svg(run.steps, knees, predicted, title))
        report["plot"] = args.plot
    print(json.dumps(report, indent=2) if args.json else format_ramp(report))
    return 0


def _pool(args: argparse.Namespace, metrics_text: str) -> KVPool | None:
    if args.kv_blocks:
        return KVPool(args.kv_blocks, args.block_size or 16)
    return pool_from_metrics(metrics_text)


def ramp_report(steps: list[Any], knees: list[Knee], pool: KVPool | None, predicted: dict[int, int]) -> dict[str, Any]:
    return {
        "kv_pool": None
        if pool is None
        else {"blocks": pool.blocks, "block_size": pool.block_size, "tokens": pool.tokens},
        "steps": [s.to_json() for s in steps],
        "critical_context": [
            {
                "concurrency": k.concurrency,
                "measured": k.critical_context,
                "knee_input": k.knee_input,
                "reason": k.reason,
                "predicted": predicted.get(k.concurrency),
            }
            for k in knees
        ],
    }


def format_ramp(report: dict[str, Any]) -> str:
    lines = [
        f"{'conc':>4} {'input':>6} {'prompt':>7} {'TTFT p50':>9} {'TTFT max':>9} {'out tok/s':>9} "
        f"{'KV peak':>7} {'waiting':>7} {'preempt':>7} {'queue s':>7} {'prefill s':>9} {'decode s':>8} {'err':>3}"
    ]
    for s in report["steps"]:
        lines.append(
            f"{s['concurrency']:>4} {s['input_tokens']:>6} {s['prompt_tokens']:>7.0f} {s['ttft_p50']:>9.3f} "
            f"{s['ttft_max']:>9.3f} {s['output_tokens_per_s']:>9.1f} {s['kv_usage_max']:>7.0%} "
            f"{s['waiting_max']:>7.0f} {s['preemptions']:>7.0f} {s['queue_s_mean']:>7.3f} "
            f"{s['prefill_s_mean']:>9.3f} {s['decode_s_mean']:>8.3f} {s['errors']:>3}"
        )
    pool = report["kv_pool"]
    lines.append("")
    if pool:
        lines.append(f"KV pool: {pool['blocks']:,} blocks x {pool['block_size']} = {pool['tokens']:,} tokens")
    lines.append(f"{'concurrency':>11} {'critical context measured':>26} {'knee at':>8} {'why':>12} {'predicted':>10}")
    for k in report["critical_context"]:
        measured = "-" if k["measured"] is None else f"{k['measured']:,}"
        if k["reason"] is None:
            measured = f">= {measured}"
        knee = "-" if k["knee_input"] is None else f"{k['knee_input']:,}"
        predicted = "-" if k["predicted"] is None else f"{k['predicted']:,}"
        lines.append(f"{k['concurrency']:>11} {measured:>26} {knee:>8} {k['reason'] or 'no knee':>12} {predicted:>10}")
    if "plot" in report:
        lines.append(f"\nplot: {report['plot']}")
    return "\n".join(lines)
