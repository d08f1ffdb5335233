"""One arrangement's simulated prefix cache: what vLLM would serve a prompt, from message digests.

The engine model (:class:`proxy.enginemodel.PrefixCache`, what ``prefix-proxy analyze`` replays
through) hashes token ids in 16-token blocks, and a request reuses the longest run of leading
blocks already cached, never its last token. On the request path there are no token ids (no
tokenizer runs on a request), so this model keeps the same rules over what the proxy already has:
the chain of message digests (:func:`proxy.observability.digests.chain`, ``links[k]`` names the
header and the first ``k`` messages) and each message's rendered bytes, turned into tokens at a
per-byte rate. A prompt is served

* every message whose chain link a prompt of this arrangement carried before;
* the reply the backend generated right after a prompt it was sent (vLLM caches generated
  tokens): an assistant message whose predecessor chain ended a prompt;
* within the first leading system message that differs, the lines before its first new one
  (vLLM's blocks do not stop at message boundaries; a system prompt that changes at its line 40
  still hits its first 39). The tools are rendered after the first system message's text, as the
  engine model's template renders them (``proxy.enginemodel.chat_template``: Qwen, Hermes): a
  change in that text recomputes every tool, a change in the tools leaves that text cached;

then cut to whole blocks and to the prompt's length less one token, as vLLM cuts it.

What it does not see: a difference inside a message other than a leading system one (the message
counts as new from its start), eviction by other apps' prompts (each app has its own model),
and template tokens other than a fixed ``framing_tokens`` per message. Its errors fall alike on
the two arrangements the shadow compares, so the comparison holds where the absolute figure errs.

Bounded: at most ``max_links`` chain links, two generations (when the newer holds half, it
becomes the older and the older is forgotten; a prefix found only in the older is copied to the
newer, so what is used survives); where an app's prompts are longer, a generation holds two of its
longest (up to ``GROWTH`` times ``max_links``), so that a long conversation's prefix is copied once
in many requests, not on each; per place a system message was seen (its parent link), the line
hashes of the last ``LINE_LISTS`` texts there, in at most ``max_links // 16`` places. Work per
prompt: a binary search over its links, then only the links past what it found, and for a leading
system message it did not find, a comparison in C of its line hashes with the few kept at its place.

Pure: no I/O, no clock; the caller serializes access.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import xxhash
from cachetools import LRUCache

from proxy.observability.digests import ASSISTANT, PromptDigest, chain, content_text, header_key
from proxy.openai import extend_links, shared_length

# The texts of a system message kept per place it was seen (a prompt's variants in the engine's
# cache are mostly the last few: an app's clock, its retrieved chunks).
LINE_LISTS = 8
# Prompts kept whose history's links wait to be made (``ArrangementCache._links``).
PENDING_PROMPTS = 4
# How far a cache grows past ``max_links`` to hold an app's longest prompts (``_remember``).
GROWTH = 16


# Role markers a ChatML-like template renders around each message (``<|im_start|>user\n`` ...
# ``<|im_end|>\n``): a message inserted by a rewrite costs them too.
FRAMING_TOKENS = 5


@dataclass(frozen=True, slots=True)
class Served:
    """What the model expects the backend to do with one prompt, in estimated tokens."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class ArrangementCache:
    """The prefix cache one arrangement of an app's prompts would build."""

    __slots__ = ("_block_size", "_half", "_lines_at", "_max_half", "_new", "_old", "_pending")

    def __init__(self, max_links: int = 4096, block_size: int = 16) -> None:
        self._block_size = max(1, block_size)
        self._half = max(2, max_links // 2)
        self._max_half = GROWTH * self._half
        # chain link -> True where a prompt ended there (the backend generated a reply after it).
        self._new: dict[int, bool] = {}
        self._old: dict[int, bool] = {}
        # A system message's parent link -> the line hashes of the last texts seen there.
        self._lines_at: LRUCache[int, list[tuple[int, ...]]] = LRUCache(max(1, max_links // 16))
        # Prompts sent whose history's links are not made yet, by the link of their leading system
        # messages (see ``_links``).
        self._pending: LRUCache[int, PromptDigest] = LRUCache(PENDING_PROMPTS)

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def serve(
        self, prompt: PromptDigest, messages: Sequence[Any], tokens_per_byte: float, *, remember: bool = True
    ) -> Served:
        """What the backend would serve ``prompt`` (whose ``messages`` are given for the lines of a
        leading system message it did not find); then remember it as sent."""
        links, partial = self._links(prompt)
        count = len(prompt)
        found = self._reach(links)  # links[: found + 1] known (-1: not even the header)
        served = self._served(prompt, links, found)
        cached_messages = max(0, served)
        cached_bytes = prompt.bytes_at(cached_messages) if served >= 0 else 0
        seen_lines: tuple[int, tuple[int, ...]] | None = None
        if cached_messages < prompt.system_count:
            # A leading system message that differs: the lines before its first new one hit, and its
            # lines are remembered for the next prompt.
            index = cached_messages
            if index == 0:
                # The template renders the tools after the first system message's text (Qwen,
                # Hermes; Llama 3 in the first user turn): a change inside that text recomputes
                # every tool, and the text does not depend on them.
                parent = _untooled_header(prompt)
                cached_bytes = self._lines(parent, prompt.system_lines[0], messages[0])
            else:
                parent = links[index]
                cached_bytes += self._lines(parent, prompt.system_lines[index], messages[index])
            seen_lines = (parent, prompt.system_lines[index])
        prompt_tokens = int(prompt.total_bytes * tokens_per_byte) + FRAMING_TOKENS * count
        cached = int(cached_bytes * tokens_per_byte) + FRAMING_TOKENS * cached_messages
        cached = max(0, min(cached, prompt_tokens - 1))
        cached -= cached % self._block_size
        if remember:
            self._remember(links, found, served, seen_lines, ended=not partial)
            if partial:
                self._pending[links[-1]] = prompt
        return Served(prompt_tokens, cached)

    def reach(self, prompt: PromptDigest) -> int:
        """How many leading messages of ``prompt`` this arrangement's cache holds, the reply the
        backend generated after one of its prompts included (nothing is remembered)."""
        links, _ = self._links(prompt)
        return max(0, self._served(prompt, links, self._reach(links)))

    def _links(self, prompt: PromptDigest) -> tuple[Sequence[int], bool]:
        """The prompt's chain links; or, where its leading system messages are new to this cache
        (then nothing after them can be cached), theirs only (``True``: partial): a system message
        that changes on every request (a clock) would otherwise make a link for every message of the
        history on every request, to be found by none. A prompt sent so waits (``_pending``) until
        one reaches its system messages again: its history's links are made then, once."""
        lead = prompt.system_count
        if prompt.links is None and 0 < lead < len(prompt):
            prompt.links = head = extend_links(array("Q", [header_key(prompt)]), prompt.digests[:lead])
            if not self._known(head[-1]):
                return head[:], True
            self._materialize(head[-1])
        return chain(prompt), False

    def _materialize(self, link: int) -> None:
        """The links of the prompt waiting at ``link``, remembered as when it was sent."""
        waiting = self._pending.pop(link, None)
        if waiting is None:
            return
        links = chain(waiting)
        newer, older = self._new, self._old
        # Whether a prompt ended at each, as either generation says: in C (a history's links).
        ended = list(map(any, zip(map(newer.get, links), map(older.get, links), strict=True)))
        newer.update(zip(links, ended, strict=True))
        newer[links[-1]] = True

    # -- internals ---------------------------------------------------------------------------------

    def _known(self, link: int) -> bool:
        return link in self._new or link in self._old

    def _ended(self, link: int) -> bool:
        return bool(self._new.get(link) or self._old.get(link))

    def _served(self, prompt: PromptDigest, links: Sequence[int], found: int) -> int:
        """``found``, or one more where the message after it is the reply the backend generated
        after a prompt that ended there, re-sent."""
        if 0 <= found < len(prompt) and prompt.role(found) == ASSISTANT and self._ended(links[found]):
            return found + 1
        return found

    def _reach(self, links: Sequence[int]) -> int:
        """The last index whose link is known, on the links being known as prefixes (every prompt's
        links are remembered from its header on): a binary search, not a walk over the history."""
        low, high = -1, len(links) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self._known(links[middle]):
                low = middle
            else:
                high = middle - 1
        return low

    def _lines(self, parent: int, hashes: tuple[int, ...], message: Any) -> int:
        """Bytes of the leading lines of a system message that a text seen at its place (``parent``)
        began with too: the longest such run among the texts kept there."""
        known = self._lines_at.get(parent)
        if not known:
            return 0
        matched = max(shared_length(hashes, seen) for seen in known)
        if not matched:
            return 0
        text = content_text(message.get("content")) if isinstance(message, dict) else ""
        # Each matched line's bytes and its newline, counted in C.
        return sum(map(len, text.encode("utf-8", "surrogatepass").split(b"\n", matched)[:matched])) + matched

    def _remember(
        self,
        links: Sequence[int],
        found: int,
        served: int,
        seen_lines: tuple[int, tuple[int, ...]] | None,
        *,
        ended: bool = True,
    ) -> None:
        if 2 * len(links) > self._half:
            # A prompt longer than a generation would be copied whole into each next one, on every
            # request: a generation holds at least two of the longest (up to ``GROWTH`` times).
            self._half = min(2 * len(links), self._max_half)
        newer = self._new
        if found >= 0 and links[found] not in newer:
            # Known only in the older generation: the prefix this prompt used is kept whole.
            # With whether a prompt ended there, as the older generation says (in C: a long
            # conversation's prefix is copied at each change of generation).
            prefix = links[: found + 1]
            newer.update(zip(prefix, map(bool, map(self._old.get, prefix)), strict=True))
        start = max(0, found + 1)
        newer.update(zip(links[start:], repeat(False)))
        if seen_lines is not None:
            parent, hashes = seen_lines
            known = self._lines_at.get(parent)
            if known is None:
                self._lines_at[parent] = [hashes]
            elif hashes not in known:
                known.append(hashes)
                del known[:-LINE_LISTS]
        if ended:
            newer[links[-1]] = True  # a reply is generated after it
        if len(newer) >= self._half:
            self._old, self._new = newer, {}


def _untooled_header(prompt: PromptDigest) -> int:
    """What the first system message's lines chain from: the tenant and model, not the tools."""
    return xxhash.xxh3_64_intdigest(f"{prompt.namespace}\x00{prompt.model}".encode("utf-8", "surrogatepass"))
