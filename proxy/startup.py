"""The start-up line: what this proxy is and what it found, in one JSON log line.

Version, listen and metrics addresses, every upstream with its probe result, the canonicalization
mode, the store and whether it answers, the tenants. A backend that does not serve the API, or a
store that does not answer, gets a warning line of its own naming the URL (password masked) and
the fix, so a wrong ``--upstream`` shows at start rather than as a 404 on every request.
"""

from __future__ import annotations

import logging
from typing import Any

from proxy import __version__, readiness
from proxy.config import Settings
from proxy.config_sources import masked_url

logger = logging.getLogger("prefix_proxy.startup")


def startup_fields(settings: Settings, result: readiness.Readiness) -> dict[str, Any]:
    metrics = (
        f"{settings.metrics_host or settings.host}:{settings.metrics_port}/metrics"
        if settings.metrics_port is not None
        else f"{settings.host}:{settings.port}/metrics"
    )
    return {
        "event": "started",
        "version": __version__,
        "listen": f"{settings.host}:{settings.port}",
        "metrics": metrics,
        "upstreams": [check.summary() for check in result.backends],
        "canon_mode": settings.canon.mode,
        "model_modes": dict(settings.canon.model_modes),
        "store": result.store.summary(),
        "tenants": len(settings.tenants),
        "tenants_in_redis": settings.sessions.tenants_in_redis,
        "ready": result.ready,
        "readiness": result.state,
    }


def announce(settings: Settings, result: readiness.Readiness) -> None:
    logger.info("started", extra={"fields": startup_fields(settings, result)})
    for check in result.backends:
        if not check.serves_the_api:
            logger.warning("upstream %s (%s) %s: %s", check.name, check.url, check.status, check.detail)
    for line in result.warnings:
        logger.warning("%s", line)
    summarizer_model = settings.summarizer.model
    served = {model for check in result.backends if check.serves_the_api for model in check.models}
    if settings.summarizer.enabled and summarizer_model and served and summarizer_model not in served:
        logger.warning(
            "summarizer.model %r is not a model the backends serve (%s): every summary will fail and long "
            "conversations go unsummarized; set it to one of them, or remove it to summarize with the "
            "conversation's own model",
            summarizer_model,
            ", ".join(sorted(served)[:8]),
        )
    if result.store.status != readiness.UP:
        logger.warning(
            "session store %s at %s %s: requests pass through without sessions until it does; %s",
            result.store.kind,
            masked_url(settings.sessions.redis_url),
            f"answered with an error ({result.store.answered})" if result.store.answered else "does not answer",
            "/readyz answers 503 meanwhile (readiness.require_store)"
            if settings.readiness.require_store
            else "the replica stays ready, degraded (readiness.require_store: false)",
        )
