"""The shadow: never worse than direct, by construction, per app.

A rewrite is a bet on the next requests: a block moved out of the system prompt pays when the
prompt stops changing, and costs when it then sits after something that changes anyway. A rule
that is wrong for a client nobody tested would lose that bet on every request. So, per app, the
proxy keeps two simulated
prefix caches (:class:`~proxy.observability.shadowcache.ArrangementCache`): one fed the requests
as the client sent them, one fed them as forwarded. Each request's prefill is estimated on both;
the difference is what rewriting cost (positive) or saved (negative) on it.

An app is a tenant, a model and a template: requests whose system prompts share most of their
lines. A prompt's *sketch* is the ``SKETCH`` smallest hashes of its system prompt's lines (the
digest has them already); it joins the template of its tenant and model whose sketch it shares at
least half of, else starts one. A line that varies enters the sketch only when its hash is among
the smallest, and then displaces one: a template is recognized through its varying lines.
Requests without a system prompt are an app per tool set.

A *trial* is a run of rewritten requests, counted from the first one the rewrite changed (an app
whose rewrites wait for what varies to show itself is not judged on its as-sent requests and its
first move, whose gain comes a turn later). Once it holds ``window`` requests, the sum of the
differences over the whole trial so far is its verdict, checked on every request: more than one
block's worth (``block_size`` tokens) and the app's rewrites stop. The sum covers the whole trial,
not its last ``window`` requests: a rewrite that saves a new conversation its system prompt and
tools and then costs a few tokens of framing on each later turn pays, and a sliding window that
has forgotten the saving would see only the costs. The app's new conversations then go as sent,
byte for byte, for ``backoff`` requests, then a new trial starts with a new conversation (a
conversation held as sent is not rewritten mid-way); each lost trial doubles the back-off (up to
``max_backoff``), a trial that lasted ``4 * window`` requests resets it. While rewrites are
stopped both caches are still fed (the same prompt), so the next trial starts from what the
backend really holds.

A conversation the backend holds rewritten when its app's rewrites stop would recompute its
history if it switched layout. It stays rewritten until what the app's conversations kept so
have cost since the last switch reaches the price of switching this one (its history, as the
two caches see it), then goes as sent: a rule that costs little per turn keeps the conversations
it began, one that costs much gives them up after about a history's worth.

A mistaken rule then costs an app, per trial, ``window`` requests and at most about a history's
worth per conversation it was rewriting, and the trials grow rarer: a regret bounded per trial,
not a session's worth.

Pure: no I/O, no clock; the caller serializes access (one event loop). Bounded: ``max_apps`` apps,
least recently used out, each with two caches of at most ``max_links`` links.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from proxy.canon import leading_system_count
from proxy.observability.digests import PromptDigest, digest_after_lead, line_hashes
from proxy.observability.shadowcache import ArrangementCache, Served
from proxy.openai import Continuations

# What a conversation's kept message lists may hold, per arrangement (characters).
KEPT_CHARS = 8 << 20
# Leading system messages looked for, at most, before a prompt's history (a list is not walked whole).
MAX_LEAD = 16
# Line hashes a system prompt's sketch keeps, the share two sketches have in common to be one
# template, and the templates a tenant's model keeps.
SKETCH = 8
SKETCH_MATCH = 0.5
TEMPLATES_PER_MODEL = 32
_BLANK = line_hashes("")[0]


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
    # The current trial's differences (forwarded - client prefill), summed over all its requests:
    # what a rewrite saved on a conversation's first request still counts against the framing
    # its later turns pay (a sliding window would forget the gain and keep the costs).
    balance: int = 0
    # What the conversations kept rewritten while rewrites are stopped cost since the last switch.
    held_extra: int = 0
    # Requests of the trial since the first one it changed, and whether it changed one yet.
    trial_requests: int = 0
    placed: bool = False


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether to rewrite a request; ``trial_started``: it is the first of a new trial. ``app`` and
    ``client``: its app and its digest as sent, for :meth:`RewriteShadow.account`."""

    rewrite: bool
    app: Hashable
    client: PromptDigest
    scope: str
    trial_started: bool = False
    # Rewritten only because the backend holds its conversation rewritten (rewrites are stopped).
    held: bool = False


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
        # (tenant, model) -> its templates' sketches, by template id.
        self._templates: LRUCache[tuple[str, str], dict[int, frozenset[int]]] = LRUCache(max(1, self.settings.max_apps))
        # The last message lists digested per conversation, each arrangement its own: a request
        # digests only what it adds (proxy.openai.continuation).
        self._client_lists: Continuations[PromptDigest] = Continuations(KEPT_CHARS)
        self._forwarded_lists: Continuations[PromptDigest] = Continuations(KEPT_CHARS)

    def __len__(self) -> int:
        return len(self._apps)

    def admit(self, scope: str, client: dict[str, Any]) -> Admission:
        """Whether the request ``client`` (as sent; ``scope``: its tenant) is rewritten: not while
        its app's rewrites are stopped (counts the requests of a back-off)."""
        prompt = _digest(self._client_lists, scope, client, None)
        app = (scope, prompt.model, self._template(scope, prompt))
        state = self._apps.get(app)
        if state is None or state.rewriting:
            return Admission(True, app, prompt, scope)
        messages = client.get("messages") or []
        switch = self._switch_cost(state, prompt, messages)
        if switch > self.settings.block_size:
            # A conversation the backend holds in the rewritten layout: as sent, its history would be
            # computed again. It stays rewritten until what staying cost the app's held conversations
            # since the last switch reaches that price (rent until renting cost what buying does:
            # at most twice the cheaper choice, whether the conversation ends soon or never).
            if state.held_extra < switch:
                return Admission(True, app, prompt, scope, held=True)
            state.held_extra = 0
        if state.waiting > 0:
            state.waiting -= 1
            return Admission(False, app, prompt, scope)
        if self._continued(state, prompt):
            return Admission(False, app, prompt, scope)  # a trial starts with a new conversation
        state.rewriting = True
        state.balance = 0
        state.held_extra = 0
        state.trial_requests = 0
        state.placed = False
        return Admission(True, app, prompt, scope, trial_started=True)

    def account(
        self,
        admission: Admission,
        client: dict[str, Any],
        forwarded: dict[str, Any],
        *,
        forwarded_system_count: int | None = None,
        tokens_per_byte: float = 0.25,
    ) -> Verdict:
        """The request :meth:`admit` admitted, as the client sent it and as forwarded (the same
        object where it went as sent)."""
        app, scope, rewritten = admission.app, admission.scope, admission.rewrite
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
        client_prompt = admission.client
        client_served = state.client.serve(client_prompt, client_messages, tokens_per_byte)
        if forwarded is client:
            forwarded_prompt, forwarded_messages = client_prompt, client_messages
        else:
            forwarded_messages = forwarded.get("messages") or []
            forwarded_prompt = _digest(self._forwarded_lists, scope, forwarded, forwarded_system_count)
        forwarded_served = state.forwarded.serve(forwarded_prompt, forwarded_messages, tokens_per_byte)
        verdict = Verdict(client_served, forwarded_served, rewritten)
        if admission.held:
            state.held_extra += verdict.extra_tokens
        if not (rewritten and state.rewriting):
            return verdict
        if not state.placed:
            if forwarded_prompt.tools == client_prompt.tools and forwarded_prompt.digests == client_prompt.digests:
                # Nothing rewritten yet: the trial's bet is not placed and its window not begun. An
                # app whose first rewrite waits for what varies to show itself is judged on the
                # requests it rewrote, not on its first one with the as-sent ones before it.
                state.balance += verdict.extra_tokens
                return verdict
            state.placed = True
        return self._judge(state, verdict)

    def _switch_cost(self, state: _App, prompt: PromptDigest, messages: Sequence[Any]) -> int:
        """What the prompt as sent would lose on what the backend holds (the forwarded layout)
        against its own layout, in tokens: more than a block where its conversation went out
        rewritten; 0 for a prompt that continues no conversation."""
        if not self._continued(state, prompt):
            return 0
        own = state.client.serve(prompt, messages, 0.25, remember=False).cached_tokens
        held = state.forwarded.serve(prompt, messages, 0.25, remember=False).cached_tokens
        return own - held

    @staticmethod
    def _continued(state: _App, prompt: PromptDigest) -> bool:
        """Whether the prompt continues a conversation seen before: as the client lays it out, it
        re-sends a reply the backend generated after its system prompt and first user turn (a layout
        switch would cost that history). Counted in messages: a short turn continues too."""
        return state.client.reach(prompt) > prompt.system_count + 1

    def _template(self, scope: str, prompt: PromptDigest) -> Hashable:
        """The id of the prompt's template among its tenant's model's (made when none matches)."""
        lines = {h for message in prompt.system_lines for h in message if h != _BLANK}
        if not lines:
            return ("tools", prompt.tools)
        sketch = frozenset(heapq.nsmallest(SKETCH, lines))
        key = (scope, prompt.model)
        templates = self._templates.get(key)
        if templates is None:
            templates = self._templates[key] = {}
        best, best_shared = None, 0
        for template, known in templates.items():
            shared = len(sketch & known)
            if shared > best_shared and shared >= SKETCH_MATCH * min(len(sketch), len(known)):
                best, best_shared = template, shared
        if best is not None:
            return best
        if len(templates) >= TEMPLATES_PER_MODEL:
            del templates[next(iter(templates))]  # the oldest
        template = min(sketch)
        templates[template] = sketch
        return template

    def _judge(self, state: _App, verdict: Verdict) -> Verdict:
        settings = self.settings
        state.balance += verdict.extra_tokens
        state.trial_requests += 1
        if state.trial_requests == 4 * settings.window:
            state.backoff = settings.backoff  # a trial that held this long: the next loss starts over
        if state.trial_requests < settings.window or state.balance <= settings.block_size:
            return verdict
        excess = state.balance
        state.rewriting = False
        state.waiting = state.backoff
        backoff = state.backoff
        state.backoff = min(settings.max_backoff, state.backoff * 2)
        return Verdict(verdict.client, verdict.forwarded, verdict.rewritten, stopped=excess, backoff=backoff)


def _digest(
    lists: Continuations[PromptDigest], scope: str, body: dict[str, Any], system_count: int | None
) -> PromptDigest:
    """The prompt's digest, resumed on its history after its leading system messages: a client's
    system message may change on every request (a clock) while its history comes back as it was."""
    messages = body.get("messages") or []
    if system_count is None:
        system_count = leading_system_count(messages, MAX_LEAD)
    history = messages[system_count:]
    resumed = lists.resume(scope, history)
    prompt = digest_after_lead(body, scope, system_count, resumed.state, resumed.shared)
    resumed.keep(history, prompt)
    return prompt
