"""Instructions per request, counted by valgrind: a before/after figure a noisy machine cannot blur.

    python -m bench.instructions [--shape dify] [--requests 200] [--before CHECKOUT] [--bare [--json]]
                                 [--settings JSON] [--cache-sim] [--patch FILE]
                                 [--history TURNS [--style dify|agent] [--session] [--summary]]

CPU time on a shared 2-core machine drifts by 20-40% between runs of the same build, which hides a
change worth 5%. The instructions the proxy's code executes do not drift: this runs
``bench.inprocess`` (the app driven in process, the instant backend in another process, which
valgrind does not follow) under callgrind twice, with ``--requests`` more requests the second time,
and divides the difference by them, so start-up and warm-up cancel out. What the driver itself does
per request (making each request's body from ``bench.shapes``: a ``json.dumps`` of the whole
request, about as much as the proxy's logic on the Dify row) is counted the same way with
``bench.inprocess --bodies-only`` and taken off (``--with-driver`` keeps it in). ``--before`` counts
another checkout the same way (with its own ``.venv`` where it has one), for a ratio.

An instruction is not a nanosecond (a cache miss costs more than an add), so this says whether a
change made the code do less, and by how much; the wall-clock figures stay ``bench.hop``'s.
``--cache-sim`` has callgrind simulate the caches too and adds an estimate of cycles per request
(instructions + 10 per first-level miss + 100 per last-level miss, callgrind's own weighting): a
change that does less but touches more memory shows there. Needs valgrind (``apt-get install
valgrind``); a run takes about a minute per hundred requests (twice that with ``--cache-sim``).

``--history TURNS`` counts one conversation of ``bench.history`` resumed at TURNS earlier turns
(``bench.inprocess --history``): what a request costs at that length, against a machine's noise.

``--patch FILE`` counts a prototype without changing the proxy: ``bench.inprocess --patch`` runs
the file before it builds the app (this checkout's count only; ``--before .`` counts the same
checkout without it, for the prototype's ratio).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import shapes

# The first run's requests per round (start-up and warm-up are the same in both runs).
BASELINE_REQUESTS = 20

_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")
# callgrind's summary with --cache-sim=yes: first-level and last-level misses, instructions and data.
_MISSES = re.compile(r"(I1|LLi|D1|LLd)\s+misses:\s*([\d,]+)")


def count(
    source: Path, args: argparse.Namespace, requests: int, bodies_only: bool = False, patched: bool = False
) -> int:
    """Instructions (or, with ``--cache-sim``, estimated cycles) callgrind counts in one run of
    ``bench.inprocess`` from ``source`` (``bodies_only``: the driver making the bodies alone;
    ``patched``: with ``--patch``)."""
    own_python = source / ".venv" / "bin" / "python"
    python = str(own_python) if own_python.exists() else sys.executable
    command = [python, "-m", "bench.inprocess", "--rounds", "1", "--requests", str(requests)]
    command += ["--shape", args.shape, "--settings", args.settings]
    if args.history:
        command += ["--history", str(args.history), "--style", args.style, "--protocol", args.protocol]
        command += (["--session"] if args.session else []) + (["--summary"] if args.summary else [])
    command += (["--bare"] if args.bare else []) + (["--json"] if args.json else [])
    command += ["--bodies-only"] if bodies_only else []
    command += ["--patch", str(args.patch.resolve())] if patched and args.patch is not None else []
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out"]
        valgrind += ["--cache-sim=yes"] if args.cache_sim else []
        done = subprocess.run(valgrind + command, cwd=source, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind on {source} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    if not args.cache_sim:
        return int(found.group(1))
    misses = {name: int(value.replace(",", "")) for name, value in _MISSES.findall(done.stderr)}
    first_level, last_level = misses["I1"] + misses["D1"], misses["LLi"] + misses["LLd"]
    return int(found.group(1)) + 10 * first_level + 100 * last_level


def per_request(source: Path, args: argparse.Namespace, bodies_only: bool = False, patched: bool = False) -> float:
    with ThreadPoolExecutor(2) as pool:
        small = pool.submit(count, source, args, BASELINE_REQUESTS, bodies_only, patched)
        large = pool.submit(count, source, args, BASELINE_REQUESTS + args.requests, bodies_only, patched)
        return (large.result() - small.result()) / args.requests


def proxy_per_request(source: Path, args: argparse.Namespace, here: Path, patched: bool = False) -> float:
    """Per request, the driver's own work taken off (counted from ``source``'s driver where it can
    make the bodies alone, else from this checkout's: the same shapes unless they changed)."""
    measured = per_request(source, args, patched=patched)
    if args.with_driver:
        return measured
    driver = source if "--bodies-only" in (source / "bench" / "inprocess.py").read_text() else here
    return measured - per_request(driver, args, bodies_only=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--shape", default="dify", choices=shapes.SHAPE_NAMES)
    parser.add_argument("--requests", type=int, default=200, help="the requests the two runs differ by")
    parser.add_argument("--before", type=Path, help="another checkout of prefix-proxy, counted too")
    parser.add_argument("--bare", action="store_true", help="bench.bare_hop's app: the stack without logic")
    parser.add_argument("--json", action="store_true", help="with --bare: the body parsed and written again")
    parser.add_argument("--settings", default="{}", help="settings overrides (JSON), as bench.inprocess")
    parser.add_argument("--cache-sim", action="store_true", help="estimate cycles with callgrind's cache simulation")
    parser.add_argument("--with-driver", action="store_true", help="keep the driver's body making in the count")
    parser.add_argument("--patch", type=Path, help="a prototype run before the app is built (this checkout only)")
    parser.add_argument("--history", type=int, default=0, metavar="TURNS", help="bench.inprocess --history TURNS")
    parser.add_argument("--style", choices=("dify", "agent"), default="dify", help="with --history")
    parser.add_argument("--protocol", choices=("chat", "messages"), default="chat", help="with --history")
    parser.add_argument("--session", action="store_true", help="with --history: an x-session-id header")
    parser.add_argument("--summary", action="store_true", help="with --history: a summary in place")
    args = parser.parse_args(argv)
    if args.json and not args.bare:
        parser.error("--json parses the body in the bare stack: give it with --bare")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    here = Path(__file__).resolve().parent.parent
    after = proxy_per_request(here, args, here, patched=True)
    unit = "estimated cycles" if args.cache_sim else "instructions"
    stack = (" (bare + JSON)" if args.json else " (bare)") if args.bare else ""
    name = args.shape
    if args.history:
        extras = "".join(f", {flag}" for flag in ("session", "summary") if getattr(args, flag))
        on = " on /v1/messages" if args.protocol == "messages" else ""
        name = f"{args.style}{on}, {args.history} turns{extras}"
    line = f"{name}{stack}: {after / 1e6:.3f} M {unit} per request"
    if args.before is not None:
        before = proxy_per_request(args.before.resolve(), args, here)
        line += f", before {before / 1e6:.3f} M ({after / before:.3f}x)"
    print(line)


if __name__ == "__main__":
    main()
