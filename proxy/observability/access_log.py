"""One structured JSON line per request; prompt text never appears unless asked for."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from proxy.http.context import RequestContext
from proxy.openai.jsonio import dumps

ACCESS_LOGGER = "prefix_proxy.access"
_access = logging.getLogger(ACCESS_LOGGER)


class JsonFormatter(logging.Formatter):
    # UTC: the "Z" the timestamps end with says so.
    converter = staticmethod(time.gmtime)

    def __init__(self) -> None:
        super().__init__()
        # The formatted second, reused by every line logged within it (strftime per line is measurable).
        self._second: tuple[int, str] = (-1, "")

    def _timestamp(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second[0]:
            self._second = (second, self.formatTime(record, "%Y-%m-%dT%H:%M:%S"))
        return f"{self._second[1]}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": self._timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        else:
            payload["message"] = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            payload["exception"] = self.formatException(record.exc_info)
        return dumps(payload, default=str).decode()


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("prefix_proxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_request(ctx: RequestContext, overhead_ms: float, extra: dict[str, Any] | None = None) -> None:
    if not _access.isEnabledFor(logging.INFO):
        return
    usage = ctx.usage
    fields: dict[str, Any] = {
        "event": "request",
        "request_id": ctx.request_id,
        "route": ctx.route,
        "status": ctx.status,
        "model": ctx.model,
        "tenant": ctx.tenant,
        "stream": ctx.stream,
        "session": ctx.session_id,
        "prefix": ctx.prefix_hash,
        "backend": ctx.backend,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "actions": ctx.actions,
        "overhead_ms": round(overhead_ms, 3),
    }
    upstream = ctx.upstream_seconds()
    if upstream is not None:
        fields["upstream_ms"] = round(upstream * 1000, 3)
    if ctx.error_code:
        fields["error"] = ctx.error_code
    if ctx.cache_break is not None:
        fields["cache_break"] = ctx.cache_break.explanation.to_json()
    if ctx.logged_messages is not None:
        fields["messages"] = ctx.logged_messages
    if extra:
        fields.update(extra)
    # The record made directly: Logger.info would walk the stack for a caller no access line shows.
    record = _access.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields})
    _access.handle(record)
