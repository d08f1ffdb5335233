"""The shadow on the request path: rewrite a request, or forward it as sent where its app's
rewrites lost (:mod:`proxy.observability.shadow`), and say so (actions, metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.canon import CanonResult, leading_system_count, stable_prefix_hash
from proxy.config import Settings
from proxy.http import RequestContext
from proxy.observability import RewriteShadow, ShadowSettings
from proxy.tokenization import TYPICAL_TOKENS_PER_BYTE

if TYPE_CHECKING:
    from proxy.app_state import ProxyState


def rewrite_or_forward(state: ProxyState, ctx: RequestContext, chat: dict[str, Any], tenant: str) -> CanonResult:
    """``chat`` canonicalized, or as sent (byte for byte) while its app's rewrites are stopped."""
    shadow = state.shadow
    if shadow is None or ctx.shadow_accounted:
        # A retry of a request the shadow admitted to a rewrite (a strict template refused the
        # rewrite's message order): rewritten again, not accounted twice.
        return state.canonicalizer.apply(chat, tenant)
    metrics = state.metrics
    admission = shadow.admit(tenant, chat)
    if admission.trial_started:
        ctx.actions.append("rewrite_trial_started")
        metrics.rewrite_trials.labels("started").inc()
    if admission.rewrite:
        canon = state.canonicalizer.apply(chat, tenant)
    else:
        canon = as_sent(chat)
        ctx.actions.append("forwarded_as_sent:shadow")
        metrics.requests_sent_as_is.inc()
    verdict = shadow.account(
        admission,
        chat,
        canon.body,
        forwarded_system_count=canon.stable_count,
        tokens_per_byte=TYPICAL_TOKENS_PER_BYTE,
    )
    metrics.shadow_prefill_tokens.labels("client").inc(verdict.client.prefill_tokens)
    metrics.shadow_prefill_tokens.labels("forwarded").inc(verdict.forwarded.prefill_tokens)
    if verdict.stopped:
        # This request went rewritten; the app's next ones go as sent for ``backoff`` requests.
        ctx.actions.append(f"rewrites_stopped:extra={verdict.stopped};backoff={verdict.backoff}")
        metrics.rewrite_trials.labels("stopped").inc()
    return canon


def as_sent(chat: dict[str, Any]) -> CanonResult:
    """The request unchanged (canonicalization's ``off``)."""
    messages = chat.get("messages")
    count = leading_system_count(messages) if isinstance(messages, list) else 0
    return CanonResult(chat, [], stable_prefix_hash(chat, count), count)


def rewrite_shadow(settings: Settings) -> RewriteShadow | None:
    """The shadow ``canon.shadow`` asks for; None where it is off or nothing is ever rewritten."""
    canon = settings.canon
    if not canon.shadow.enabled or (canon.mode == "off" and not canon.model_modes):
        return None
    section = canon.shadow
    return RewriteShadow(
        ShadowSettings(
            window=section.window,
            backoff=section.backoff_requests,
            max_backoff=section.max_backoff_requests,
            max_apps=section.max_apps,
            max_links=section.max_links,
            block_size=settings.cache_breaks.block_size,
        )
    )
