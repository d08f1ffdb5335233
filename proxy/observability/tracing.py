"""OpenTelemetry traces: one server span per request of the forwarded API (optional extra ``otel``).

The span opens with the request's context (its parent: the client's ``traceparent``, if any), its
context goes upstream in the request's headers (W3C ``traceparent`` / ``tracestate``, or what
``OTEL_PROPAGATORS`` names), and it ends where the access-log line is written
(:func:`proxy.routes.forward.account`), with the same facts as attributes: tenant, session,
canonicalization actions, cache-break cause, backend, upstream timing, usage. Never prompt text
(``ctx.logged_messages`` is not read). docs/metrics.md, "Traces (OpenTelemetry)".

Off (the default), nothing of OpenTelemetry is imported and a request pays a ``None`` check where a
span would start, go upstream and end. On, ended spans leave through a ``BatchSpanProcessor``:
ending one only queues it (dropped when the queue is full), the export runs on the SDK's thread,
and a collector that fails or hangs is the SDK's to log, never a request's to wait for.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.http import RequestContext

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from starlette.requests import Request

    from proxy.config import TracingSettings

INSTALL_HINT = "pip install 'prefix-proxy[otel]'"
TRACER_NAME = "prefix_proxy"
PREFIX = "prefix_proxy."
OTLP_HTTP_TRACES_PATH = "/v1/traces"
# A passed-through path is the client's: the span's name keeps this much of it.
MAX_PATH_CHARS = 256


class TracingUnavailable(SystemExit):
    """Tracing asked for without the packages it needs: one line at start-up, not a traceback
    (what a ``SystemExit`` carrying a message prints)."""


def start_tracing(settings: TracingSettings, exporter: SpanExporter | None = None) -> RequestTracer | None:
    """The app's tracer; None when ``tracing.enabled`` is false. ``exporter``: where spans go
    instead of the one ``tracing.exporter`` names (tests: the SDK's in-memory exporter)."""
    if not settings.enabled:
        return None
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TracingUnavailable(
            f"tracing.enabled is true but OpenTelemetry is not installed: {INSTALL_HINT}"
        ) from None
    return RequestTracer(settings, exporter if exporter is not None else build_exporter(settings))


def build_exporter(settings: TracingSettings) -> SpanExporter:
    """``tracing.exporter``, sending to ``tracing.endpoint`` (unset: the ``OTEL_EXPORTER_OTLP_*``
    variables the SDK reads, else its defaults, localhost:4318 / :4317)."""
    try:
        if settings.exporter == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter(service_name=settings.service_name)
        if settings.exporter == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter(endpoint=settings.endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp_http_endpoint(settings.endpoint))
    except ImportError:
        raise TracingUnavailable(f"tracing.exporter {settings.exporter!r} is not installed: {INSTALL_HINT}") from None


def otlp_http_endpoint(endpoint: str | None) -> str | None:
    """An OTLP/HTTP endpoint given as the collector's base URL (``http://collector:4318``) gets the
    traces path, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does; a URL with a path is taken as it is."""
    if endpoint is None or urlsplit(endpoint).path.strip("/"):
        return endpoint
    return endpoint.rstrip("/") + OTLP_HTTP_TRACES_PATH


def _version() -> str:
    try:
        return version("prefix-proxy")
    except PackageNotFoundError:
        return "unknown"


class RequestTracer:
    """The tracer provider of one app, and the request span's three moments."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        release = _version()
        resource = Resource.create({"service.name": settings.service_name, "service.version": release})
        # The app's own provider, not the process-wide one: nothing else in the process is changed.
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer(TRACER_NAME, release)
        self._extract = propagate.extract
        self._inject = propagate.inject
        self._in_context = trace.set_span_in_context
        self._server = trace.SpanKind.SERVER
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR

    def start(self, request: Request, ctx: RequestContext) -> None:
        """Open ``ctx``'s span (from the request's arrival), the client's trace context its parent."""
        method = request.method
        path = request.scope["path"][:MAX_PATH_CHARS]
        ctx.span = self._tracer.start_span(
            f"{method} {path}",
            context=self._extract(request.headers),
            kind=self._server,
            attributes={"http.request.method": method, "http.route": path, "url.path": path},
            start_time=time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9),
        )

    def inject(self, ctx: RequestContext, headers: MutableMapping[str, str]) -> None:
        """Add the span's context to the headers of the request sent upstream."""
        if ctx.span is not None:
            self._inject(headers, context=self._in_context(ctx.span))

    def end(self, ctx: RequestContext, overhead_s: float) -> None:
        """End ``ctx``'s span with the request's facts (when the access-log line is written)."""
        span = ctx.span
        if span is None:
            return
        ctx.span = None
        if span.is_recording():
            span.set_attributes(request_attributes(ctx, overhead_s))
            if failed(ctx):
                span.set_status(self._status(self._error, ctx.error_code or f"status {ctx.status}"))
        span.end()

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: at most the exporter's timeout)."""
        self.provider.shutdown()


def failed(ctx: RequestContext) -> bool:
    """A server error, or an answer that started well and broke off (a stream cut short); not the
    client hanging up, nor the client's own 4xx."""
    if ctx.status >= 500:
        return True
    return ctx.status < 400 and ctx.error_code is not None and ctx.error_code != "client_disconnected"


def request_attributes(ctx: RequestContext, overhead_s: float) -> dict[str, Any]:
    """The span's attributes: the access-log line's facts (:func:`proxy.observability.access_log.
    log_request`) by its names, under ``prefix_proxy.``; unknown ones left out. No prompt text."""
    attributes: dict[str, Any] = {
        "http.response.status_code": ctx.status,
        PREFIX + "request_id": ctx.request_id,
        PREFIX + "route": ctx.route,
        PREFIX + "tenant": ctx.tenant,
        PREFIX + "stream": ctx.stream,
        PREFIX + "actions": tuple(ctx.actions),
        PREFIX + "overhead_ms": round(overhead_s * 1000, 3),
    }
    optional: dict[str, Any] = {
        "model": ctx.model,
        "session": ctx.session_id,
        "prefix": ctx.prefix_hash,
        "backend": ctx.backend,
        "error": ctx.error_code,
    }
    usage = ctx.usage
    if usage is not None:
        optional.update(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
    upstream = ctx.upstream_seconds()
    if upstream is not None:
        optional["upstream_ms"] = round(upstream * 1000, 3)
    if ctx.upstream_sent_at is not None and ctx.upstream_headers_at is not None:
        optional["upstream_ttfb_ms"] = round((ctx.upstream_headers_at - ctx.upstream_sent_at) * 1000, 3)
    if ctx.first_chunk_at is not None:
        optional["ttft_ms"] = round((ctx.first_chunk_at - ctx.started) * 1000, 3)
    if ctx.cache_break is not None:
        explanation = ctx.cache_break.explanation.to_json()
        optional["cache_break"] = explanation.pop("cause")
        for key, value in explanation.items():
            optional["cache_break." + key] = value
    for key, value in optional.items():
        if value is not None:
            attributes[PREFIX + key] = value
    if failed(ctx):
        attributes["error.type"] = ctx.error_code or str(ctx.status)
    return attributes
