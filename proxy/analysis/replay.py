"""Replaying captured traffic through a canonicalization mode and vLLM's prefix-cache model.

For each captured request, in arrival order: canonicalize it as the proxy would (the real
:class:`~proxy.canon.canonicalizer.Canonicalizer`, its memories included), render it with the chat
template vLLM applies (the Qwen2.5 / ChatML template of :mod:`proxy.enginemodel.chat_template`),
tokenize it, and admit it to a :class:`~proxy.enginemodel.prefix_cache.PrefixCache`; then cache
the reply the backend actually gave (captured), as vLLM caches generated tokens, and feed its tool
calls to the tool-call memory, as the proxy does. The same miss explanation as the proxy's names
the cause of every break.

What it does not model: summaries and sliding-window repair (the proxy applies them in every
canonicalization mode, so they shift all modes alike), concurrency (requests run one after
another, so a request never waits for blocks), and templates other than ChatML (``--tokenizer``
changes the token ids, not the template).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.analysis.captured import Captured
from proxy.canon import Canonicalizer
from proxy.config import CanonMode, CanonSettings
from proxy.enginemodel import ChatTemplateError, ChatTokenizer, PrefixCache, render_chat
from proxy.observability import NONE, BreakMemory, digest_prompt, message_hash
from proxy.openai import ToolCall

MODES: tuple[CanonMode, ...] = ("off", "safe", "relocate")
IM_END = "<|im_end|>\n"


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "prefill_tokens": self.prefill_tokens,
        }


@dataclass
class ModeResult:
    mode: str
    total: Tally = field(default_factory=Tally)
    apps: dict[str, Tally] = field(default_factory=dict)
    cause_requests: Counter[str] = field(default_factory=Counter)
    cause_tokens: Counter[str] = field(default_factory=Counter)
    skipped: int = 0


AppOf = Callable[[Captured], str]


def app_of(record: Captured) -> str:
    """An app is a tenant and a model: one API key per app is how Dify and Open WebUI deploy."""
    return f"{record.tenant}/{record.body.get('model', '')}"


def replay(
    records: Iterable[Captured],
    mode: CanonMode,
    tokenizer: ChatTokenizer,
    *,
    canon: CanonSettings | None = None,
    block_size: int = 16,
    capacity_blocks: int = 1 << 20,
    app: AppOf = app_of,
) -> ModeResult:
    settings = (canon or CanonSettings()).model_copy(update={"mode": mode, "model_modes": {}})
    canonicalizer = Canonicalizer(settings)
    cache = PrefixCache(block_size=block_size, capacity_blocks=capacity_blocks)
    breaks = BreakMemory(block_size=block_size)
    result = ModeResult(mode)
    for record in records:
        canonical = canonicalizer.apply(record.body, record.tenant)
        forwarded = canonical.body
        try:
            prompt_text = render_chat(forwarded["messages"], forwarded.get("tools"))
        except (ChatTemplateError, KeyError, TypeError, AttributeError):
            result.skipped += 1
            continue
        prompt_ids = tokenizer.encode(prompt_text)
        if not prompt_ids or cache.blocks_needed(len(prompt_ids)) > capacity_blocks:
            result.skipped += 1
            continue
        # The proxy salts each configured tenant's requests (tenant_cache_isolation).
        salt = record.tenant if record.tenant != "anonymous" else None
        blocks = cache.admit(prompt_ids, salt)
        if blocks is None:  # cannot happen one at a time, but never crash on a capture
            result.skipped += 1
            continue
        cache.finish(blocks, _reply_ids(tokenizer, forwarded, record.reply, prompt_text))
        if record.reply is not None:
            canonicalizer.record_reply(forwarded, record.tenant, _calls(record.reply))

        prompt = digest_prompt(forwarded, record.tenant, system_count=canonical.stable_count)
        moved = any(str(action).startswith("volatile_moved") for action in canonical.actions)
        conversation = f"{record.tenant}\x1f{record.session}" if record.session else None
        explanation, prompt_id = breaks.observe(prompt, conversation, moved_volatile=moved)
        explanation.settle(len(prompt_ids), blocks.num_cached_tokens)
        breaks.calibrate(prompt_id, len(prompt_ids))
        if record.reply is not None:
            breaks.record_reply(prompt_id, *message_hash(record.reply))
        if explanation.cause != NONE:
            result.cause_requests[explanation.cause] += 1
            result.cause_tokens[explanation.cause] += explanation.tokens_lost

        result.total.add(len(prompt_ids), blocks.num_cached_tokens)
        result.apps.setdefault(app(record), Tally()).add(len(prompt_ids), blocks.num_cached_tokens)
    return result


def _reply_ids(
    tokenizer: ChatTokenizer, forwarded: dict[str, Any], reply: dict[str, Any] | None, prompt_text: str
) -> list[int]:
    """The tokens the backend generated: the reply as the template renders it after the prompt,
    then the end token (vLLM caches all but the last sampled token)."""
    if not reply:
        return [tokenizer.eos_token_id]
    try:
        full = render_chat([*forwarded["messages"], reply], forwarded.get("tools"), add_generation_prompt=False)
    except (ChatTemplateError, KeyError, TypeError, AttributeError):
        full = ""
    if full.startswith(prompt_text):
        text = full[len(prompt_text) :].removesuffix(IM_END)
    else:
        content = reply.get("content")
        text = content if isinstance(content, str) else ""
    return [*tokenizer.encode(text), tokenizer.eos_token_id]


def _calls(reply: dict[str, Any]) -> list[ToolCall]:
    calls = []
    for call in reply.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            calls.append(
                ToolCall(
                    str(call.get("id", "")),
                    str(function.get("name", "")),
                    arguments if isinstance(arguments, str) else "",
                )
            )
    return calls


def captured_tally(records: Iterable[Captured]) -> Tally:
    """What the backend reported while the capture ran."""
    tally = Tally()
    for record in records:
        if record.prompt_tokens:
            tally.add(record.prompt_tokens, record.cached_tokens)
    return tally
