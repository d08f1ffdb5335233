"""Canonicalization cost per request (the pure engine, with its memories), by request size.

    python -m bench.canon_cost [--iterations 300]

Requests are built like the workload's worst cases: a Dify RAG system prompt with a
timestamp, the bundled BFCL tools (19) in shuffled order with shuffled keys, and a history
of tool calls with fresh ids, padded to about 4k, 8k and 32k tokens (the tools and the
system prompt alone are ~3k). Each iteration gets a new timestamp, tool order and ids, so
nothing is served from a cache that real traffic would not have.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from proxy.canon import Canonicalizer
from proxy.config import CanonSettings
from proxy.tokenization import load_encoding
from testbed.workload.session import shuffle_keys

TOOLS_DIR = Path(__file__).resolve().parents[1] / "testbed" / "workload" / "data" / "tools"
PARAGRAPH = (
    "Refunds are issued to the original payment method within five business days after the returned "
    "item arrives at the warehouse and passes inspection. Orders shipped abroad may take longer. "
)


def build_request(turns: int, rng: random.Random) -> dict[str, Any]:
    tools = [tool for path in sorted(TOOLS_DIR.glob("*.json")) for tool in json.loads(path.read_text())]
    rng.shuffle(tools)
    system = (
        f"<context>\n{PARAGRAPH * 6}\n</context>\n"
        f"Current time: 2026-11-29T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z\n"
        "You are the support agent of an online shop. Use the tools when needed.\n" + PARAGRAPH * 10
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        call_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        messages.append({"role": "user", "content": f"Question {turn}: " + PARAGRAPH * 2})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_ticket", "arguments": json.dumps({"ticket_id": turn})},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": PARAGRAPH})
        messages.append({"role": "assistant", "content": "Here is what I found. " + PARAGRAPH})
    messages.append({"role": "user", "content": "And what about my refund?"})
    return {"model": "m", "messages": messages, "tools": [shuffle_keys(t, rng) for t in tools]}


def request_tokens(body: dict[str, Any]) -> int:
    return len(load_encoding().encode_ordinary(json.dumps(body, ensure_ascii=False)))


def turns_for(tokens: int) -> int:
    """The number of history turns that brings a request to about ``tokens`` tokens."""
    turns = 0
    while request_tokens(build_request(turns + 1, random.Random(0))) <= tokens:
        turns += 1
    return max(turns, 0)


def measure(tokens: int, iterations: int) -> tuple[float, float, int]:
    rng = random.Random(tokens)
    canonicalizer = Canonicalizer(CanonSettings())
    turns = turns_for(tokens)
    requests = [build_request(turns, rng) for _ in range(iterations)]
    actual = request_tokens(requests[0])
    timings = []
    for body in requests:
        started = time.perf_counter()
        canonicalizer.apply(body, "tenant")
        timings.append(time.perf_counter() - started)
    timings.sort()
    return statistics.median(timings) * 1e3, timings[int(0.99 * (len(timings) - 1))] * 1e3, actual


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    print(f"{'request':>10}{'tokens':>9}{'median ms':>11}{'p99 ms':>9}")
    for target in (4000, 8000, 32000):
        median, p99, actual = measure(target, args.iterations)
        print(f"{f'~{target // 1000}k':>10}{actual:>9}{median:>11.3f}{p99:>9.3f}")


if __name__ == "__main__":
    main()
