"""Why a request missed the prefix cache: where its prompt first diverges from what was forwarded.

vLLM reuses the longest run of leading 16-token blocks it already holds, so a request pays
prefill from the first token that differs from every prompt the backend saw (and still holds).
The proxy sees every prompt it forwards; this module keeps them as hash chains (``digests``),
bounded, least recently used out, and answers per request:

* how far the longest forwarded prefix reaches (messages, estimated tokens): what the backend
  should serve from its cache;
* where, against the conversation's previous prompt (or, for a conversation's first request,
  the app's most similar one), the prompt first differs, and why, as one of :data:`CAUSES`;
* once usage arrives, whether the backend served less than that prefix (``cache_evicted``).

"Tokens lost" is the estimated prefill the break costs: the tokens the previous prompt shared
with this one from the break on (for ``new_conversation``, everything after the shared system
prompt: a first turn's prefill, which no proxy can save). Appending a turn is no break.

Pure logic: no I/O, no clock; the caller serializes access (one event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachetools import LRUCache

from proxy.observability.digests import ASSISTANT, SYSTEM, USER, PromptDigest, chain
from proxy.openai import shared_length
from proxy.recent import LastWritten, peek
from proxy.tokenization import TYPICAL_TOKENS_PER_BYTE

CAUSES = (
    "new_conversation",
    "tools_changed",
    "system_changed",
    "history_edited",
    "history_trimmed",
    "summary_compacted",
    "model_output_rewritten",
    "volatile_moved",
    "cache_evicted",
    "unknown",
)
NONE = "none"

# A system prompt shares at least this share of its lines with an app's earlier one to count as
# the same app with a changed prompt (rather than another app): the same bar learned volatility uses.
SAME_APP_LINES = 0.5
APP_PROMPTS = 8


@dataclass(slots=True)
class Forwarded:
    """A forwarded prompt and, once answered, the hash of the reply the backend generated."""

    prompt: PromptDigest
    tokens_per_byte: float
    reply: int | None = None
    reply_bytes: int = 0

    def tokens(self, count: int | None = None) -> int:
        size = self.prompt.total_bytes if count is None else self.prompt.bytes_at(count)
        return int(size * self.tokens_per_byte)


@dataclass
class CacheBreak:
    """One request's explanation; ``settle`` refines it with the backend's usage."""

    cause: str = NONE
    # Index of the first message that differs (-1: the tools), None when there is no break.
    message: int | None = None
    # Line of that (system) message that differs first.
    line: int | None = None
    tokens_lost: int = 0
    # Estimated tokens the backend should serve from its cache (the longest forwarded prefix).
    expected_cached: int = 0
    # What the estimates rest on, calibrated by ``settle``.
    prompt_bytes: int = 0
    break_bytes: int = 0
    expected_bytes: int = 0
    lost_bytes: int = 0
    block_size: int = 16
    settled: bool = False

    def settle(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """Calibrate the estimates on the reported prompt tokens; flag what the backend lost.

        Expected cached tokens: the forwarded prefix, cut to full blocks and to ``prompt - 1``
        (vLLM always recomputes the last token). Served fewer by more than two blocks and a tenth
        (estimates are per-byte): the prefix was evicted, or the request went to a cold replica.
        ``cached_tokens`` None: the engine does not say (nothing is judged evicted).
        """
        if self.settled or prompt_tokens <= 0:
            return
        self.settled = True
        per_byte = prompt_tokens / self.prompt_bytes if self.prompt_bytes else TYPICAL_TOKENS_PER_BYTE
        expected = min(int(self.expected_bytes * per_byte), prompt_tokens - 1)
        self.expected_cached = max(0, expected - expected % self.block_size)
        self.tokens_lost = int(self.lost_bytes * per_byte)
        if cached_tokens is None:
            return
        shortfall = self.expected_cached - cached_tokens
        if shortfall > max(2 * self.block_size, self.expected_cached // 10) and self.cause in (NONE, "unknown"):
            self.cause = "cache_evicted"
            self.tokens_lost = shortfall
            self.message = None
            self.line = None

    def header(self) -> str:
        """``x-prefix-proxy-cache-break``: ``cause; message=M; line=L; tokens=T`` or ``none``."""
        if self.cause == NONE:
            return NONE
        parts = [self.cause]
        if self.message is not None:
            parts.append(f"message={self.message}")
        if self.line is not None:
            parts.append(f"line={self.line}")
        parts.append(f"tokens={self.tokens_lost}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "cause": self.cause,
            "message": self.message,
            "line": self.line,
            "tokens_lost": self.tokens_lost,
            "expected_cached": self.expected_cached,
        }


@dataclass(frozen=True)
class Comparison:
    """A prompt against a given earlier one (the cache diagnostics a client asks for by naming
    the earlier answer): what changed first, in the order the backend renders it, and where.

    ``changed`` is None when the prompt starts with the whole earlier one (its cache was usable).
    ``message`` is the first forwarded message that differs (-1: the tools, None: nothing); the
    byte counts are the earlier prompt's, so that tokens missed are what the earlier request had
    put in the cache."""

    changed: str | None
    message: int | None
    line: int | None
    shared_bytes: int
    previous_bytes: int
    tokens_per_byte: float

    @property
    def missed_tokens(self) -> int:
        """Tokens of the earlier prompt after the first difference: what its cache could have served."""
        return int(max(0, self.previous_bytes - self.shared_bytes) * self.tokens_per_byte)

    @property
    def reusable_tokens(self) -> int:
        """Tokens of the earlier prompt a prompt starting with it could reuse."""
        return int(self.previous_bytes * self.tokens_per_byte)

    @property
    def divergence_token(self) -> int:
        """About where, in tokens, the prompts first differ."""
        return int(self.shared_bytes * self.tokens_per_byte)


@dataclass
class _App:
    prompts: list[int] = field(default_factory=list)


class BreakMemory:
    """Bounded memories of forwarded prompts, by prefix, conversation and app: each forgets its
    least recently written entries (reading one, with :func:`peek`, is no use)."""

    def __init__(self, max_prompts: int = 20_000, block_size: int = 16) -> None:
        self.block_size = block_size
        self._prompts: LRUCache[int, Forwarded] = LRUCache(max(1, max_prompts))
        # Prefix chain link -> id of the last prompt that went through it.
        self._links: LastWritten[int, int] = LastWritten(max_prompts * 8)
        self._conversations: LRUCache[str, int] = LRUCache(max(1, max_prompts))
        self._apps: LRUCache[tuple[str, str], _App] = LRUCache(max(1, max_prompts // 8))
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._prompts)

    # -- the hot path ------------------------------------------------------------------------

    def observe(
        self,
        prompt: PromptDigest,
        conversation: str | None = None,
        *,
        moved_volatile: bool = False,
        tokens_per_byte: float | None = None,
    ) -> tuple[CacheBreak, int]:
        """Explain ``prompt``, then remember it as forwarded; returns (explanation, prompt id)."""
        per_byte = tokens_per_byte or TYPICAL_TOKENS_PER_BYTE
        links = chain(prompt)
        reach = self._reach(links)
        previous = self._previous(conversation, links, reach, prompt)
        result = self._explain(prompt, previous, reach, moved_volatile)
        result.block_size = self.block_size
        result.prompt_bytes = prompt.total_bytes
        # Not even the header (tenant, model, tools) was forwarded before: nothing can hit.
        result.expected_bytes = prompt.bytes_at(self._expected_messages(prompt, links, reach)) if reach >= 0 else 0
        per_token = per_byte
        result.expected_cached = int(result.expected_bytes * per_token)
        result.tokens_lost = int(result.lost_bytes * per_token)
        prompt_id = self._remember(prompt, links, conversation, per_byte, self._written(prompt, previous, reach))
        return result, prompt_id

    def record_reply(self, prompt_id: int, reply_hash: int, reply_bytes: int) -> None:
        """The backend generated this reply (it caches its tokens too)."""
        forwarded = peek(self._prompts, prompt_id)
        if forwarded is not None:
            forwarded.reply, forwarded.reply_bytes = reply_hash, reply_bytes

    def calibrate(self, prompt_id: int, prompt_tokens: int) -> None:
        forwarded = peek(self._prompts, prompt_id)
        if forwarded is not None and prompt_tokens > 0 and forwarded.prompt.total_bytes:
            forwarded.tokens_per_byte = prompt_tokens / forwarded.prompt.total_bytes

    def compare(self, prompt_id: int, previous_id: int) -> Comparison | None:
        """``prompt_id``'s prompt against ``previous_id``'s; None when either is forgotten."""
        current, previous = peek(self._prompts, prompt_id), peek(self._prompts, previous_id)
        if current is None or previous is None:
            return None
        new, old = current.prompt, previous.prompt
        per_byte = previous.tokens_per_byte
        if (old.namespace, old.model) != (new.namespace, new.model):
            return Comparison("model", None, None, 0, old.total_bytes, per_byte)
        if not _same_system(old, new):
            message, line = _system_difference(old, new)
            # What the backend renders ahead of the first differing system message.
            shared = old.bytes_at(message) if old.tools == new.tools else 0
            return Comparison("system", message, line, shared, old.total_bytes, per_byte)
        if old.tools != new.tools:
            return Comparison("tools", -1, None, 0, old.total_bytes, per_byte)
        common = _common_prefix(old, new)
        if common == len(old):
            return Comparison(None, None, None, old.total_bytes, old.total_bytes, per_byte)
        return Comparison("messages", common, None, old.bytes_at(common), old.total_bytes, per_byte)

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _written(prompt: PromptDigest, previous: Forwarded | None, reach: int) -> int:
        """How many of the prompt's leading links were written already, by the prompt it continues
        (this conversation's last, under the same header): they keep naming the prompt that wrote
        them, and only the links the prompt adds are written (a conversation's history is not
        written again on every request). So a link names the last prompt that added it or ended
        there, not the last that went through it: the same explanations for a conversation's
        requests (its last prompt is found by its key); a request without a conversation key may
        be compared with an earlier prompt of the conversation whose history it shares."""
        if previous is None or reach < 0:
            return 0
        old = previous.prompt
        if (old.namespace, old.model, old.tools) != (prompt.namespace, prompt.model, prompt.tools):
            return 0
        return min(_common_prefix(old, prompt), reach) + 1

    def _reach(self, links: Sequence[int]) -> int:
        """Messages of the longest forwarded prefix; -1 when even the header is new."""
        for count in range(len(links) - 1, -1, -1):
            if links[count] in self._links:
                return count
        return -1

    def _expected_messages(self, prompt: PromptDigest, links: Sequence[int], reach: int) -> int:
        """Messages the backend should hold: the forwarded prefix, and the reply it generated when
        this prompt re-sends it unchanged right where that prompt ended."""
        if reach < 0:
            return 0
        holder_id = self._links.get(links[reach])
        holder = peek(self._prompts, holder_id) if holder_id is not None else None
        if (
            holder is not None
            and len(holder.prompt) == reach
            and reach < len(prompt)
            and holder.reply == prompt.digests[reach]
        ):
            return reach + 1
        return reach

    def _previous(
        self, conversation: str | None, links: Sequence[int], reach: int, prompt: PromptDigest
    ) -> Forwarded | None:
        """The conversation's last prompt; else the last prompt that shares history with this one."""
        if conversation is not None:
            prompt_id = peek(self._conversations, conversation)
            if prompt_id is not None:
                found = peek(self._prompts, prompt_id)
                if found is not None:
                    return found
        if reach > prompt.system_count:
            holder_id = self._links.get(links[reach])
            if holder_id is not None:
                return peek(self._prompts, holder_id)
        return None

    def _explain(
        self, prompt: PromptDigest, previous: Forwarded | None, reach: int, moved_volatile: bool
    ) -> CacheBreak:
        if previous is None:
            return self._first_turn(prompt, reach)
        old = previous.prompt
        if (old.namespace, old.model) != (prompt.namespace, prompt.model):
            return self._break("unknown", None, None, prompt, previous, -1)
        if old.tools != prompt.tools:
            if _same_system(old, prompt):
                return self._break("tools_changed", -1, None, prompt, previous, -1)
            # The prompt changed from the system prompt on (another agent, a side task): its tools
            # with it, which is no sign of a client re-sending its tools differently.
            message, line = _system_difference(old, prompt)
            return self._break("system_changed", message, line, prompt, previous, -1)
        common = _common_prefix(old, prompt)
        if common == len(old):
            # The prompt extends the previous one: a break only if the reply came back rewritten.
            if (
                common < len(prompt)
                and previous.reply is not None
                and prompt.role(common) == ASSISTANT
                and prompt.digests[common] != previous.reply
            ):
                lost = min(prompt.bytes_at(common + 1), prompt.bytes_at(common) + previous.reply_bytes)
                result = CacheBreak("model_output_rewritten", common)
                result.break_bytes = prompt.bytes_at(common)
                result.lost_bytes = max(0, lost - result.break_bytes)
                return result
            return CacheBreak()
        if (
            old.role(common) == USER == prompt.role(common)
            # Only system messages before it (moved blocks included): the first question differs.
            and all(old.role(index) == SYSTEM == prompt.role(index) for index in range(common))
            and common not in (old.summary_at, prompt.summary_at)
            and not _shifted(old, prompt, common)
        ):
            # Same system prompt, another first question: another conversation (a chat's title or
            # follow-up task after the one before it), not an edit of this one's history.
            return self._first_turn(prompt, reach)
        start = max(common, reach)
        cause, line = self._cause(old, prompt, common, moved_volatile)
        return self._break(cause, common, line, prompt, previous, start)

    def _cause(self, old: PromptDigest, new: PromptDigest, at: int, moved_volatile: bool) -> tuple[str, int | None]:
        if at == new.summary_at or at == old.summary_at:
            return "summary_compacted", None
        if at < max(old.system_count, new.system_count):
            if moved_volatile:
                return "volatile_moved", None
            if at < old.system_count and at < new.system_count:
                return "system_changed", _first_difference(old.system_lines[at], new.system_lines[at])
            return "system_changed", None
        if new.role(at) == SYSTEM or old.role(at) == SYSTEM:
            # A system message inside the history: a block of volatile lines the proxy moved there
            # (before the shift test: removing such a block also shifts the history).
            return "volatile_moved", None
        if _shifted(old, new, at):
            return "history_trimmed", None
        if new.role(at) == ASSISTANT and old.role(at) == ASSISTANT:
            return "model_output_rewritten", None
        return "history_edited", None

    def _break(
        self, cause: str, message: int | None, line: int | None, prompt: PromptDigest, previous: Forwarded, start: int
    ) -> CacheBreak:
        result = CacheBreak(cause, message, line)
        shared_end = min(prompt.total_bytes, int(previous.prompt.total_bytes))
        result.break_bytes = prompt.bytes_at(max(start, 0)) if start >= 0 else 0
        result.lost_bytes = max(0, shared_end - result.break_bytes)
        if result.lost_bytes == 0:
            return CacheBreak()
        return result

    def _first_turn(self, prompt: PromptDigest, reach: int) -> CacheBreak:
        """A conversation's first request: compared with the app's closest earlier system prompt."""
        app = self._closest_app_prompt(prompt)
        if app is not None and reach < prompt.system_count:
            old = app.prompt
            if old.tools != prompt.tools and _same_system(old, prompt):
                cause, message, line = "tools_changed", -1, None
            else:
                message, line = _system_difference(old, prompt)
                cause = "system_changed"
            system_end = min(prompt.bytes_at(prompt.system_count), old.bytes_at(old.system_count))
            result = CacheBreak(cause, message, line)
            result.break_bytes = prompt.bytes_at(max(reach, 0))
            result.lost_bytes = max(0, system_end - result.break_bytes)
            if result.lost_bytes:
                return result
        result = CacheBreak("new_conversation", max(reach, 0))
        result.break_bytes = prompt.bytes_at(max(reach, 0))
        result.lost_bytes = prompt.total_bytes - result.break_bytes
        return result

    def _closest_app_prompt(self, prompt: PromptDigest) -> Forwarded | None:
        app = peek(self._apps, (prompt.namespace, prompt.model))
        if app is None or not prompt.system_lines:
            return None
        lines = prompt.system_lines[0]
        best: tuple[float, Forwarded] | None = None
        for prompt_id in app.prompts:
            found = peek(self._prompts, prompt_id)
            if found is None or not found.prompt.system_lines:
                continue
            score = _similarity(prompt.namespace, lines, found.prompt.system_lines[0])
            if score >= SAME_APP_LINES and (best is None or score > best[0]):
                best = (score, found)
        return best[1] if best else None

    def _remember(
        self, prompt: PromptDigest, links: Sequence[int], conversation: str | None, per_byte: float, written: int = 0
    ) -> int:
        """Remember the prompt; ``written``: its leading links already written (``_written``). Its
        last link is written whatever: the prompt that ended there last (a regenerated answer's)
        holds the reply the backend cached there."""
        prompt_id = self._next_id
        self._next_id += 1
        self._prompts[prompt_id] = Forwarded(prompt, per_byte)
        self._links.write(links[min(written, len(links) - 1) :] if written else links, prompt_id)
        if conversation is not None:
            self._conversations[conversation] = prompt_id
        key = (prompt.namespace, prompt.model)
        app = peek(self._apps, key) or _App()
        system = prompt.system_lines[0] if prompt.system_lines else ()
        # One entry per distinct system prompt, most recent first.
        kept = [
            p
            for p in app.prompts
            if (found := peek(self._prompts, p)) is not None
            and (found.prompt.system_lines[0] if found.prompt.system_lines else ()) != system
        ]
        app.prompts = [prompt_id, *kept][:APP_PROMPTS]
        self._apps[key] = app
        return prompt_id


# The similarity of recent pairs of system prompts, by tenant and the line tuples' identities (the
# digests' cache hands out one tuple per system message): an app's first turns compare the same
# prompts again and again. Per tenant: no tenant's request is faster for another's.
Lines = tuple[int, ...]
_SIMILARITIES: LRUCache[tuple[str, int, int], tuple[Lines, Lines, float]] = LRUCache(1024)


def _similarity(namespace: str, ours: Lines, theirs: Lines) -> float:
    """The share of lines two system prompts have in common (of the lines either has)."""
    key = (namespace, id(ours), id(theirs))
    known = _SIMILARITIES.get(key)
    if known is not None and known[0] is ours and known[1] is theirs:
        return known[2]
    a, b = set(ours), set(theirs)
    score = len(a & b) / max(len(a | b), 1)
    _SIMILARITIES[key] = (ours, theirs, score)
    return score


def _common_prefix(old: PromptDigest, new: PromptDigest) -> int:
    """How many leading messages the two prompts have alike (their digests compared in C)."""
    return shared_length(old.digests, new.digests)


def _same_system(old: PromptDigest, new: PromptDigest) -> bool:
    """The leading system messages are the same (a break in front of them is in the tools)."""
    count = old.system_count
    return count == new.system_count and old.digests[:count] == new.digests[:count]


def _system_difference(old: PromptDigest, new: PromptDigest) -> tuple[int, int | None]:
    """The first message that differs, and its first differing line when both prompts have a
    system message there."""
    message = _common_prefix(old, new)
    line = None
    if message < min(old.system_count, new.system_count):
        line = _first_difference(old.system_lines[message], new.system_lines[message])
    return message, line


def _first_difference(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """The first line (1-based, as editors count) that differs."""
    return shared_length(old, new) + 1


def _shifted(old: PromptDigest, new: PromptDigest, at: int) -> bool:
    """The new history continues the old one from a later message: a window slid (the oldest
    messages were dropped), so everything after the system prompt moved up."""
    if at >= len(new):
        return False
    return new.digests[at] in old.digests[at + 1 :]
