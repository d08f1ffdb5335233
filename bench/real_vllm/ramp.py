"""``prefix-proxy ramp`` against the real vLLM (CPU build) with a deliberately small KV pool.

vLLM is started with ``--num-gpu-blocks-override`` so the pool holds only ``blocks x block_size``
tokens; the ramp reads the pool from vLLM's ``cache_config_info`` and predicts the critical context
length at each concurrency (pool / concurrency - output), next to the knee it measures:

    .venv/bin/python -m bench.real_vllm.ramp [--blocks 64] [--concurrency 1,4] \\
        [--input-lengths 128,256,384,512,768,1024,1536] [--output-length 32] [--plot docs/img/ramp.svg]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.real_vllm.engine import RealVLLM, unavailable_reason
from proxy.cli import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_vllm.ramp", description=__doc__)
    parser.add_argument("--blocks", type=int, default=64, help="KV pool size in blocks of 32 tokens")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--input-lengths", default="128,256,384,512,768,1024,1536")
    parser.add_argument("--output-length", type=int, default=32)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--plot", default="ramp-real-vllm.svg")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason(install=True, preset=args.preset)) is not None:
        print(f"real vLLM unavailable: {reason}", file=sys.stderr)
        return 2
    block_size = 32  # the CPU attention backend needs a multiple of 32
    # vLLM refuses a context longer than its pool, less the null block it keeps aside.
    pool_tokens = (args.blocks - 1) * block_size
    with RealVLLM(
        block_size=block_size,
        max_model_len=pool_tokens,
        preset=args.preset,
        extra_args=("--num-gpu-blocks-override", str(args.blocks)),
    ) as engine:
        command = [
            "ramp",
            "--upstream",
            engine.openai_base_url,
            "--model",
            engine.model,
            "--concurrency",
            args.concurrency,
            "--input-lengths",
            args.input_lengths,
            "--output-length",
            str(args.output_length),
            "--plot",
            args.plot,
        ]
        if args.json:
            command.append("--json")
        return cli_main(command)


if __name__ == "__main__":
    sys.exit(main())
