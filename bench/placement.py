"""Where should a moved block go? The workload through the proxy once per ``canon.relocate_target``.

A block that changes every turn (a timestamp, retrieved context) costs each turn the tokens
between where the previous turn had it and the end of the prompt. Placing it

- ``before_last_user``: the next turn recomputes the block, the previous question and answer;
- ``after_last_user``: the block and the previous answer (the question stays cached), but the
  model reads the block after the question (the client put it before);
- ``system_end``: everything after the system prompt (tools and the whole history) whenever the
  block changes; the choice for chat templates that take one system message.

Blocks that do not change within a conversation go where the conversation saw them first,
whatever the target. Run::

    python -m bench.placement [--sessions 32] [--scenarios dify_rag,timestamp_user]

Prints, per scenario, the prefill tokens computed with each target and as a share of direct.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.config import Settings
from testbed.demo import run_demo
from testbed.workload import overall

TARGETS = ("before_last_user", "after_last_user", "system_end")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenarios", default=None, help="comma-separated (default: the demo's)")
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, int]] = {}
    direct: dict[str, int] = {}
    for target in TARGETS:
        print(f"running relocate_target={target} ...", file=sys.stderr)
        result = run_demo(
            sessions=args.sessions,
            seed=args.seed,
            scenarios=args.scenarios,
            progress=False,
            settings=Settings(canon={"relocate_target": target}),
        )
        for name, scenario in {**result.proxied, "overall": overall(result.proxied.values())}.items():
            rows.setdefault(name, {})[target] = scenario.prefill_tokens
        for name, scenario in {**result.direct, "overall": overall(result.direct.values())}.items():
            direct[name] = scenario.prefill_tokens
    header = f"| scenario | direct | {' | '.join(TARGETS)} |"
    print(header)
    print("|" + " --- |" * (len(TARGETS) + 2))
    for name, by_target in rows.items():
        cells = [f"{by_target[t]:,} ({by_target[t] / direct[name]:.2f}x)" if direct[name] else "-" for t in TARGETS]
        print(f"| {name} | {direct[name]:,} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
