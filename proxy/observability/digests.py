"""A forwarded prompt as 64-bit hashes: what the miss explanation compares, never the text.

Each message is hashed on what a chat template renders from it: the role, the content text
(list content joined as vLLM's string format joins it), and for tool calls the function name
and the arguments as the template re-serializes them (parsed, then ``json.dumps``). Tool-call
ids and key order inside a message are left out: common templates (Qwen, Hermes, Llama 3)
never render them, so a client that changes them costs nothing, and hashing them would report
breaks the backend never sees. The leading system messages are also hashed line by line, so a
break there can name the line.

Sizes are kept in bytes; tokens are estimated from them (``tokens_per_byte``) and calibrated
on the request's own reported ``prompt_tokens``: no tokenization on the hot path.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add
from typing import Any

import orjson
import xxhash
from cachetools import FIFOCache

from proxy.canon import leading_system_count
from proxy.openai import (
    ARGUMENTS_MEMO_CHARS,
    LONG_TEXT_CHARS,
    ONE_SHOT_BYTES,
    ByText,
    dumps,
    extend_links,
    memo_by_text,
    role_prefix,
    shared_dumps,
)

ROLE_CODES = {"system": 1, "developer": 1, "user": 2, "assistant": 3, "tool": 4, "function": 4}
SYSTEM, USER, ASSISTANT = 1, 2, 3


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def content_text(content: Any) -> str:
    """The text a string-format template renders: parts joined by newlines, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                texts.append(dumps(part).decode("utf-8", "replace"))
        return "\n".join(texts)
    return dumps(content).decode("utf-8", "replace")


def _arguments(arguments: Any) -> bytes:
    """Arguments in one form per rendering: the template parses them and re-serializes (json.dumps,
    keys in their order), so spacing and escapes do not count and key order does. orjson's compact
    form of the parsed value is equal exactly when that rendering is."""
    if isinstance(arguments, str):
        return _argument_string(arguments)
    try:
        return orjson.dumps(arguments)
    except TypeError:
        return dumps(arguments)


@memo_by_text(ARGUMENTS_MEMO_CHARS)
def _argument_string(arguments: str) -> bytes:
    # History re-sends the same argument strings on every turn: each is parsed once.
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return _utf8(arguments)
    try:
        return orjson.dumps(value)
    except TypeError:
        return dumps(value)


# A long text's message is hashed once per text string (``LONG_TEXT_CHARS``), with its role's prefix.
_LONG_TEXTS: ByText[tuple[int, int]] = ByText()


def message_hash(message: Any) -> tuple[int, int]:
    """(hash, rendered bytes) of one message. On every request, for every message: kept lean."""
    if not isinstance(message, dict):
        raw = dumps(message)
        return xxhash.xxh3_64_intdigest(raw), len(raw)
    content = message.get("content")
    calls = message.get("tool_calls")
    plain = not calls or not isinstance(calls, list)
    prefix = role_prefix(message.get("role"))
    # Kept by the string (``_LONG_TEXTS``): a system prompt relocation hands back, or re-sent unchanged.
    long_text = content if plain and type(content) is str and len(content) >= LONG_TEXT_CHARS else None
    if long_text is not None:
        found = _LONG_TEXTS.get(long_text, prefix)
        if found is not None:
            return found
    text = _utf8(content if isinstance(content, str) else content_text(content))
    size = len(text)
    if plain and size < ONE_SHOT_BYTES:
        return xxhash.xxh3_64_intdigest(prefix + text), size
    # Streamed, not ``prefix + text``: a long message is not copied once more to be hashed.
    digest = xxhash.xxh3_64(prefix)
    digest.update(text)
    if not calls or not isinstance(calls, list):
        found = digest.intdigest(), size
        if long_text is not None:
            _LONG_TEXTS.put(long_text, prefix, found)
        return found
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            function = {}
        name = _utf8(str(function.get("name", "")))
        arguments = _arguments(function.get("arguments"))
        digest.update(b"\x01" + name + b"\x00" + arguments)
        size += len(name) + len(arguments)
    return digest.intdigest(), size


def line_hashes(text: str) -> tuple[int, ...]:
    """The hash of each line's UTF-8 bytes (a newline is one byte of its own in UTF-8: the text's
    bytes split where the text's lines end), in C: a system prompt with a clock is new every request."""
    return tuple(map(xxhash.xxh3_64_intdigest, _utf8(text).split(b"\n")))


# Line hashes of recent system prompts, by message hash: a conversation re-sends the same one.
# Oldest hashed out first (finding one again is no use).
_SYSTEM_LINES: FIFOCache[int, tuple[int, ...]] = FIFOCache(1024)


def _system_lines(digest: int, message: dict[str, Any]) -> tuple[int, ...]:
    lines = _SYSTEM_LINES.get(digest)
    if lines is None:
        lines = _SYSTEM_LINES[digest] = line_hashes(content_text(message.get("content")))
    return lines


@dataclass(slots=True)
class PromptDigest:
    """One prompt, hashed. ``ends[i]`` is the rendered bytes of the tools and ``messages[:i]``."""

    namespace: str
    model: str
    tools: int
    digests: array[int]
    roles: bytes
    ends: array[int]
    system_count: int
    system_lines: tuple[tuple[int, ...], ...]
    # Index of the proxy's summary message, -1 without one.
    summary_at: int = -1
    # :func:`chain`'s links, as far as they are made (a resumed digest starts with its prefix's).
    links: array[int] | None = None

    def __len__(self) -> int:
        return len(self.digests)

    @property
    def total_bytes(self) -> int:
        return self.ends[-1]

    def bytes_at(self, count: int) -> int:
        """Rendered bytes of the tools and the first ``count`` messages."""
        return self.ends[max(0, min(count, len(self.digests)))]

    def role(self, index: int) -> int:
        return self.roles[index] if 0 <= index < len(self.roles) else 0


def digest_prompt(
    body: dict[str, Any],
    namespace: str = "",
    summary_at: int = -1,
    system_count: int | None = None,
    *,
    previous: PromptDigest | None = None,
    shared: int = 0,
) -> PromptDigest:
    """``previous``: the digest of a prompt whose first ``shared`` messages equal this one's
    (:mod:`proxy.openai.continuation`); their hashes, sizes and roles are taken from it, and its
    system prompt's line hashes where those messages hold the whole of it."""
    messages: Sequence[Any] = body.get("messages") or []
    tools_raw = _tools_raw(body)
    if previous is not None and shared:
        digests = previous.digests[:shared]
        ends = previous.ends[: shared + 1]
        # The tools' size comes first in every end: this prompt's, not the previous one's.
        offset = len(tools_raw) - ends[0]
        if offset:
            ends = array("Q", (end + offset for end in ends))
        roles = bytearray(previous.roles[:shared])
    else:
        shared = 0
        digests = array("Q")
        ends = array("Q", [len(tools_raw)])
        roles = bytearray()
    for message in messages[shared:]:
        _append(message, digests, ends, roles)
    if system_count is None:
        system_count = leading_system_count(messages)
    if previous is not None and system_count <= shared and system_count == previous.system_count:
        system_lines = previous.system_lines
    else:
        system_lines = _system_lines_of(messages, digests, system_count)
    # The same header and the same messages: the chain's links so far.
    linked = shared + 1 if previous is not None else 0
    return _assembled(
        body, namespace, tools_raw, digests, ends, roles, system_count, system_lines, previous, linked, summary_at
    )


def digest_after_lead(
    body: dict[str, Any],
    namespace: str,
    system_count: int,
    previous: PromptDigest | None,
    shared: int,
) -> PromptDigest:
    """:func:`digest_prompt`, where ``previous``'s history (its messages after its own leading
    system messages) begins with this prompt's first ``shared`` history messages: a prompt whose
    system message changes on every request (a clock, retrieved text) digests only its system
    messages and what its history adds. The chain is taken from ``previous`` only where the system
    messages and the header are the same too."""
    if previous is None or not shared:
        return digest_prompt(body, namespace, system_count=system_count)
    messages: Sequence[Any] = body.get("messages") or []
    tools_raw = _tools_raw(body)
    digests, ends, roles = array("Q"), array("Q", [len(tools_raw)]), bytearray()
    for message in messages[:system_count]:
        _append(message, digests, ends, roles)
    start = previous.system_count
    digests.extend(previous.digests[start : start + shared])
    offset = ends[-1] - previous.ends[start]
    shared_ends = previous.ends[start + 1 : start + shared + 1]
    # A clock that ticks keeps its message's size: the ends are the previous ones, copied in C.
    ends.extend(shared_ends if not offset else map(add, shared_ends, repeat(offset)))
    roles += previous.roles[start : start + shared]
    for message in messages[system_count + shared :]:
        _append(message, digests, ends, roles)
    system_lines = _system_lines_of(messages, digests, system_count)
    same_lead = system_count == start and digests[:start] == previous.digests[:start]
    linked = system_count + shared + 1 if same_lead else 0
    return _assembled(body, namespace, tools_raw, digests, ends, roles, system_count, system_lines, previous, linked)


def _tools_raw(body: dict[str, Any]) -> bytes:
    tools = body.get("tools") or body.get("functions") or []
    return shared_dumps(tools) if tools else b""


def _append(message: Any, digests: array[int], ends: array[int], roles: bytearray) -> None:
    digest, size = message_hash(message)
    digests.append(digest)
    ends.append(ends[-1] + size)
    role = message.get("role") if isinstance(message, dict) else None
    roles.append(ROLE_CODES.get(str(role), 0))


def _system_lines_of(messages: Sequence[Any], digests: array[int], system_count: int) -> tuple[tuple[int, ...], ...]:
    return tuple(
        _system_lines(digests[index], message)
        for index, message in enumerate(messages[:system_count])
        if isinstance(message, dict)
    )


def _assembled(
    body: dict[str, Any],
    namespace: str,
    tools_raw: bytes,
    digests: array[int],
    ends: array[int],
    roles: bytearray,
    system_count: int,
    system_lines: tuple[tuple[int, ...], ...],
    previous: PromptDigest | None,
    linked: int,
    summary_at: int = -1,
) -> PromptDigest:
    """The digest made of its parts; ``previous``'s first ``linked`` chain links where it has them and
    its header (tenant, model, tools) is this prompt's."""
    model = str(body.get("model", ""))
    tools_digest = xxhash.xxh3_64_intdigest(tools_raw)
    links = None
    if (
        linked
        and previous is not None
        and previous.links is not None
        and (previous.namespace, previous.model, previous.tools) == (namespace, model, tools_digest)
    ):
        links = previous.links[:linked]
    return PromptDigest(
        namespace=namespace,
        model=model,
        tools=tools_digest,
        digests=digests,
        roles=bytes(roles),
        ends=ends,
        system_count=system_count,
        system_lines=system_lines,
        summary_at=summary_at,
        links=links,
    )


def header_key(prompt: PromptDigest) -> int:
    """What the backend renders ahead of the messages, and what scopes its cache: tenant, model, tools."""
    digest = xxhash.xxh3_64()
    digest.update(_utf8(prompt.namespace) + b"\x00" + _utf8(prompt.model) + b"\x00")
    digest.update(prompt.tools.to_bytes(8, "little"))
    return digest.intdigest()


def chain(prompt: PromptDigest) -> array[int]:
    """``chain[k]`` names the header and ``messages[:k]`` (made once per prompt; not to be changed)."""
    links = prompt.links if prompt.links is not None else array("Q", [header_key(prompt)])
    prompt.links = extend_links(links, prompt.digests[len(links) - 1 :])
    return prompt.links
