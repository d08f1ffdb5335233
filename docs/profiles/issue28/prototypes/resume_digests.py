"""Prototype (issue 28): the observability digest of a request resumed where the last request's
messages stop being equal, instead of hashing every message again. Not the proxy's code: a patch
for measuring, run by ``bench.inprocess --patch`` before the app is built:

    python -m bench.instructions --shape agent20 --requests 40 \\
        --patch docs/profiles/issue28/prototypes/resume_digests.py --before .

It keeps only the last request's messages and digest (one conversation at a time, as the
benchmark's shapes send them) and compares messages with ``==``, which ignores the key order
that :func:`proxy.observability.digests.message_hash` sees in non-text parts and in arguments
given as objects: the real change needs a memory per conversation, bounded, and an exact test.
On the shapes' requests its digests are the ones the proxy makes (80 agent20 requests checked).
"""

from __future__ import annotations

import sys
from typing import Any

import xxhash

import proxy.observability.digests as digests
from proxy.canon import leading_system_count

_last: tuple[list[Any], digests.PromptDigest] | None = None
_whole = digests.digest_prompt


def digest_prompt(
    body: dict[str, Any], namespace: str = "", summary_at: int = -1, system_count: int | None = None
) -> digests.PromptDigest:
    global _last
    messages = body.get("messages") or []
    model = str(body.get("model", ""))
    equal = 0
    if _last is not None and _last[1].namespace == namespace and _last[1].model == model:
        for new, old in zip(messages, _last[0], strict=False):
            if new != old:
                break
            equal += 1
    if equal == 0:
        digest = _whole(body, namespace, summary_at, system_count)
    else:
        previous = _last[1]  # type: ignore[index]
        tools = body.get("tools") or body.get("functions") or []
        tools_raw = digests.shared_dumps(tools) if tools else b""
        hashes = previous.digests[:equal]
        ends = previous.ends[: equal + 1]
        roles = bytearray(previous.roles[:equal])
        for message in messages[equal:]:
            hashed, size = digests.message_hash(message)
            hashes.append(hashed)
            ends.append(ends[-1] + size)
            role = message.get("role") if isinstance(message, dict) else None
            roles.append(digests.ROLE_CODES.get(str(role), 0))
        if system_count is None:
            system_count = leading_system_count([m if isinstance(m, dict) else {} for m in messages])
        if system_count <= equal and system_count == previous.system_count:
            system_lines = previous.system_lines
        else:
            system_lines = tuple(
                digests._system_lines(hashes[i], m) for i, m in enumerate(messages[:system_count]) if isinstance(m, dict)
            )
        digest = digests.PromptDigest(
            namespace=namespace,
            model=model,
            tools=xxhash.xxh3_64_intdigest(tools_raw),
            digests=hashes,
            roles=bytes(roles),
            ends=ends,
            system_count=system_count,
            system_lines=system_lines,
            summary_at=summary_at,
        )
    _last = (list(messages), digest)
    return digest


for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").startswith("proxy") and getattr(module, "digest_prompt", None) is _whole:
        module.digest_prompt = digest_prompt  # type: ignore[attr-defined]
