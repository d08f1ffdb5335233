"""``prefix-proxy analyze FILE...``: predicted hit rate and prefill per canonicalization mode."""

from __future__ import annotations

import argparse
import json
import sys

from proxy.analysis.captured import read_capture
from proxy.analysis.floors import measure_floors
from proxy.analysis.replay import MODES, captured_tally, replay
from proxy.analysis.report import format_report, to_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="capture file(s) (capture.path; rotated parts too)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM KV block size (default 16)")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: bundled cl100k + ChatML)")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=1 << 20,
        help="KV pool size in blocks (prefix-proxy kv --gpu-memory-gib ... tells it); default: no eviction",
    )
    parser.add_argument("--config", help="the proxy's config file: its canon settings (rules, detectors) are used")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: off,safe,relocate)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from proxy.config import load_settings
    from proxy.enginemodel import load_tokenizer

    if args.block_size < 1 or args.capacity_blocks < 1:
        print("--block-size and --capacity-blocks must be positive", file=sys.stderr)
        return 2
    modes = [m for m in MODES if m in args.modes.split(",")]
    if not modes:
        print(f"--modes: pick from {', '.join(MODES)}", file=sys.stderr)
        return 2
    canon = load_settings(args.config).canon if args.config else None
    try:
        records = read_capture(args.files)
    except OSError as error:
        print(f"cannot read capture: {error}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.tokenizer)
    results = [
        replay(records, mode, tokenizer, canon=canon, block_size=args.block_size, capacity_blocks=args.capacity_blocks)
        for mode in modes
    ]
    floors = measure_floors(records, tokenizer)
    report = to_json(results, captured_tally(records), args.block_size, tokenizer.name, floors)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
