"""One structured JSON line per request; prompt text never appears unless asked for.

The line is built in one place (:class:`JsonFormatter`) and written the one way logging writes
any record, so it is the same line under the proxy's handler (``prefix-proxy serve``:
:func:`configure_logging`) and under any handler an embedding application gives the
``prefix_proxy`` loggers that formats with :class:`JsonFormatter`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from proxy.http import RequestContext
from proxy.openai import dumps

ACCESS_LOGGER = "prefix_proxy.access"
_access = logging.getLogger(ACCESS_LOGGER)


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: ``ts`` (UTC, milliseconds), ``level``, ``logger``, then the
    record's ``fields`` (the access line's) or its ``message``; an error's traceback as
    ``exception``. The one place a line of the proxy's is built."""

    # UTC: the "Z" the timestamps end with says so.
    converter = staticmethod(time.gmtime)

    def __init__(self) -> None:
        super().__init__()
        # The formatted second, reused by every line logged within it (strftime per line is measurable).
        self._second: tuple[int, str] = (-1, "")

    def _timestamp(self, created: float) -> str:
        second = int(created)
        if second != self._second[0]:
            self._second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(created)))
        return f"{self._second[1]}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if not isinstance(fields, dict):
            fields = {"message": record.getMessage()}
        if record.exc_info and record.levelno >= logging.ERROR:
            fields = {**fields, "exception": self.formatException(record.exc_info)}
        return self.line(record.created, record.levelname, record.name, fields)

    def line(self, created: float, level: str, logger: str, fields: dict[str, Any]) -> str:
        """The line of a record made at ``created`` (``time.time()``) carrying ``fields``."""
        payload = {"ts": self._timestamp(created), "level": level.lower(), "logger": logger, **fields}
        return dumps(payload, default=str).decode()


class JsonLinesHandler(logging.StreamHandler):
    """The proxy's own handler: one JSON line per record on a stream (stderr)."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self.setFormatter(JsonFormatter())


def configure_logging(level: str, stream: Any = None) -> None:
    """The proxy's loggers write JSON lines to ``stream`` (stderr) at ``level`` and above."""
    handler = JsonLinesHandler(sys.stderr if stream is None else stream)
    root = logging.getLogger("prefix_proxy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_request(ctx: RequestContext, overhead_ms: float, extra: dict[str, Any] | None = None) -> None:
    """The request's access line: a record of ``prefix_proxy.access`` at INFO carrying its
    ``fields``, which :class:`JsonFormatter` writes as one JSON line (with ``ts``, ``level`` and
    ``logger`` first). It goes through logging as any record does: the proxy's handler
    (:func:`configure_logging`), or whatever handlers and filters the embedding application
    configured. The prompt's text is among the fields only with ``log_prompts``."""
    if not _access.isEnabledFor(logging.INFO):
        return
    usage = ctx.usage
    fields: dict[str, Any] = {
        "event": "request",
        "request_id": ctx.request_id,
        **({"engine_request_id": ctx.engine_request_id} if ctx.engine_request_id else {}),
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
    sink = _sole_sink()
    if sink is not None:
        _write(sink, fields)
        return
    _access.handle(_record(fields))


def _record(fields: dict[str, Any]) -> logging.LogRecord:
    # Made directly: Logger.info would walk the stack for a caller no access line shows.
    return _access.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields})


def _sole_sink() -> JsonLinesHandler | None:
    """The proxy's own handler, where it alone gets the access line as it is (no filter on the
    access logger or the handler, no other handler on the way up, the proxy's formatter): then
    the line is written to it without a ``LogRecord``, the same line (making a record and passing
    it through logging's layers costs more than the line itself). Looked up on every line, so
    whatever is configured later takes effect at once; None: the line goes through logging."""
    if _access.filters:
        return None
    sink: JsonLinesHandler | None = None
    logger: logging.Logger | None = _access
    while logger is not None:
        for handler in logger.handlers:
            if (
                sink is not None
                or type(handler) is not JsonLinesHandler
                or handler.filters
                or handler.level > logging.INFO
                or type(handler.formatter) is not JsonFormatter
            ):
                return None
            sink = handler
        if not logger.propagate:
            break
        logger = logger.parent
    return sink


def _write(handler: JsonLinesHandler, fields: dict[str, Any]) -> None:
    """What ``handler.handle`` does with the record of ``fields``, without the record."""
    formatter: JsonFormatter = handler.formatter  # type: ignore[assignment]
    handler.acquire()
    try:
        handler.stream.write(formatter.line(time.time(), "INFO", ACCESS_LOGGER, fields) + handler.terminator)
        handler.flush()
    except RecursionError:
        raise
    except Exception:
        handler.handleError(_record(fields))  # reported on stderr as logging reports it; not raised
    finally:
        handler.release()
