"""The shadow: never worse than direct, by construction, per app.

A rewrite is a bet on the next requests: a block moved out of the system prompt pays when the
prompt stops changing, and costs when it then sits after something that changes anyway. A rule
that is wrong for a client nobody tested would lose that bet on every request. So, per app
(tenant and model: the app ``prefix-proxy analyze`` reports), the proxy keeps two simulated
prefix caches (:class:`~proxy.observability.shadowcache.ArrangementCache`): one fed the requests
as the client sent them, one fed them as forwarded. Each request's prefill is estimated on both;
the difference is what rewriting cost (positive) or saved (negative) on it.

A *trial* is a run of rewritten requests. Once it holds ``window`` requests, the sum of the
differences over the last ``window`` is its verdict: more than one block's worth (``block_size``
tokens) and the app's rewrites stop: its requests go as sent, byte for byte, for ``backoff``
requests, then a new trial starts; each lost trial doubles the back-off (up to ``max_backoff``), a
trial that lasted ``4 * window`` requests resets it. While rewrites are stopped both caches are
still fed (the same prompt), so the next trial starts from what the backend really holds.

A mistaken rule then costs at most ``window`` requests of an app per trial, and the trials grow
rarer: a regret bounded in requests, not a session's worth.

Pure: no I/O, no clock; the caller serializes access (one event loop). Bounded: ``max_apps`` apps,
least recently used out, each with two caches of at most ``max_links`` links.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachetools import LRUCache

from proxy.observability.digests import PromptDigest, digest_prompt
from proxy.observability.shadowcache import ArrangementCache, Served
from proxy.openai import Continuations

# What a conversation's kept message lists may hold, per arrangement (characters).
KEPT_CHARS = 8 << 20


@dataclass(frozen=True, slots=True)
class ShadowSettings:
    window: int = 8
    backoff: int = 8
    max_backoff: int = 1024
    max_apps: int = 256
    max_links: int = 4096
    block_size: int = 16


@dataclass(slots=True)
class _App:
    client: ArrangementCache
    forwarded: ArrangementCache
    backoff: int
    rewriting: bool = True
    # Requests still to go as sent before the next trial.
    waiting: int = 0
    # The current trial's differences (forwarded - client prefill), last ``window`` requests.
    recent: deque[int] = field(default_factory=deque)
    trial_requests: int = 0


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether to rewrite a request; ``trial_started``: it is the first of a new trial."""

    rewrite: bool
    trial_started: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request's two estimates, and whether its app's rewrites stop with it (``stopped``:
    the window's excess, in tokens, that stopped them)."""

    client: Served
    forwarded: Served
    rewritten: bool
    stopped: int = 0
    backoff: int = 0

    @property
    def extra_tokens(self) -> int:
        """What rewriting cost this request (negative: saved)."""
        return self.forwarded.prefill_tokens - self.client.prefill_tokens


class RewriteShadow:
    """Per app, the two arrangements' caches and the trial in progress."""

    def __init__(self, settings: ShadowSettings | None = None) -> None:
        self.settings = settings or ShadowSettings()
        self._apps: LRUCache[Hashable, _App] = LRUCache(max(1, self.settings.max_apps))
        # The last message lists digested per conversation, each arrangement its own: a request
        # digests only what it adds (proxy.openai.continuation).
        self._client_lists: Continuations[PromptDigest] = Continuations(KEPT_CHARS)
        self._forwarded_lists: Continuations[PromptDigest] = Continuations(KEPT_CHARS)

    def __len__(self) -> int:
        return len(self._apps)

    def admit(self, app: Hashable) -> Admission:
        """Whether ``app``'s next request is rewritten (counts the requests of a back-off)."""
        state = self._apps.get(app)
        if state is None or state.rewriting:
            return Admission(True)
        if state.waiting > 0:
            state.waiting -= 1
            return Admission(False)
        state.rewriting = True
        state.recent.clear()
        state.trial_requests = 0
        return Admission(True, trial_started=True)

    def account(
        self,
        app: Hashable,
        scope: str,
        client: dict[str, Any],
        forwarded: dict[str, Any],
        *,
        rewritten: bool,
        forwarded_system_count: int | None = None,
        tokens_per_byte: float = 0.25,
    ) -> Verdict:
        """One request of ``app`` as the client sent it and as forwarded (the same object where it
        went as sent); ``scope`` (the tenant) keeps conversations of tenants apart."""
        state = self._apps.get(app)
        if state is None:
            settings = self.settings
            state = _App(
                ArrangementCache(settings.max_links, settings.block_size),
                ArrangementCache(settings.max_links, settings.block_size),
                settings.backoff,
            )
            self._apps[app] = state
        client_messages: Sequence[Any] = client.get("messages") or []
        client_prompt = _digest(self._client_lists, scope, client, None)
        client_served = state.client.serve(client_prompt, client_messages, tokens_per_byte)
        if forwarded is client:
            forwarded_prompt, forwarded_messages = client_prompt, client_messages
        else:
            forwarded_messages = forwarded.get("messages") or []
            forwarded_prompt = _digest(self._forwarded_lists, scope, forwarded, forwarded_system_count)
        forwarded_served = state.forwarded.serve(forwarded_prompt, forwarded_messages, tokens_per_byte)
        verdict = Verdict(client_served, forwarded_served, rewritten)
        if not (rewritten and state.rewriting):
            return verdict
        return self._judge(state, verdict)

    def _judge(self, state: _App, verdict: Verdict) -> Verdict:
        settings = self.settings
        state.recent.append(verdict.extra_tokens)
        state.trial_requests += 1
        if len(state.recent) > settings.window:
            state.recent.popleft()
        if state.trial_requests == 4 * settings.window:
            state.backoff = settings.backoff  # a trial that held this long: the next loss starts over
        if len(state.recent) < settings.window:
            return verdict
        excess = sum(state.recent)
        if excess <= settings.block_size:
            return verdict
        state.rewriting = False
        state.waiting = state.backoff
        backoff = state.backoff
        state.backoff = min(settings.max_backoff, state.backoff * 2)
        return Verdict(verdict.client, verdict.forwarded, verdict.rewritten, stopped=excess, backoff=backoff)


def _digest(
    lists: Continuations[PromptDigest], scope: str, body: dict[str, Any], system_count: int | None
) -> PromptDigest:
    messages = body.get("messages") or []
    resumed = lists.resume(scope, messages)
    prompt = digest_prompt(body, scope, system_count=system_count, previous=resumed.state, shared=resumed.shared)
    resumed.keep(messages, prompt)
    return prompt
