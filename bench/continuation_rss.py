"""What the conversation memories (``proxy.openai.continuation``) hold at their bound.

    python -m bench.continuation_rss [--conversations 100000] [--turns 6]

The proxy keeps four of them (the client's messages; the forwarded ones; tool-call restoration's;
relocation's layout), each with its own copies of a request's message dicts and the texts shared,
as the proxy's copies share them. This sends ``--conversations`` distinct conversations of a system
prompt and ``--turns`` exchanges (about 6 kB of text each) into four memories at their default size
and prints the growth of the process's resident memory and how many conversations each keeps: the
memories stay at their bound however many conversations pass. ``bench.overhead --sessions`` sends
two-turn sessions, which are too short to be kept (``MIN_MESSAGES``), so its RSS figure does not
show them.
"""

from __future__ import annotations

import argparse
import resource

from proxy.openai import Continuations

MEMORIES = 4


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args(argv)
    memories: list[Continuations[None]] = [Continuations() for _ in range(MEMORIES)]
    before = max_rss_mib()
    for number in range(args.conversations):
        messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly.\n" * 20}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Conversation {number}, question {turn}: " + "why? " * 80})
            messages.append({"role": "assistant", "content": f"Answer {turn}: " + "because. " * 80})
        for memory in memories:
            copies = [dict(message) for message in messages]
            memory.resume(f"tenant-{number % 10}", copies, "part").keep(copies, None)
    print(
        f"{args.conversations:,} conversations of {len(messages)} messages into {MEMORIES} memories: "
        f"RSS +{max_rss_mib() - before:.0f} MiB; conversations kept per memory: {len(memories[0]):,}"
    )


if __name__ == "__main__":
    main()
