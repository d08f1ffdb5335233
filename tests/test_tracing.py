"""OpenTelemetry traces: one server span per request, its context sent upstream as ``traceparent``,
the access log's facts as attributes and never prompt text; an exporter that fails or hangs costs
the requests nothing; spans reach a real OTLP receiver (HTTP and gRPC) over the wire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.app import create_app
from proxy.backends import backend_name
from proxy.config import Settings, TracingSettings
from proxy.observability.tracing import RequestTracer, otlp_http_endpoint, start_tracing
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import CHAT_PATH, MODEL, LiveServer, free_port, stream_chat

SECRET = "the vault code is 7-4-1-9"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@dataclass
class Traced:
    server: LiveServer
    exporter: SpanExporter
    tracer: RequestTracer

    def span(self, request_id: str, timeout_s: float = 5.0) -> ReadableSpan:
        """The one span of the request ``request_id`` (a whole answer's ends just after it is sent)."""
        assert isinstance(self.exporter, InMemorySpanExporter)
        deadline = time.monotonic() + timeout_s
        while True:
            self.tracer.provider.force_flush()
            spans = [
                s for s in self.exporter.get_finished_spans() if attrs(s).get("prefix_proxy.request_id") == request_id
            ]
            if spans or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(spans) == 1, f"{len(spans)} spans for {request_id}"
        return spans[0]


@pytest.fixture
def traced_proxy(fake_backend: LiveServer) -> Iterator[Callable[..., Traced]]:
    """A proxy whose spans go to ``exporter`` (the SDK's in-memory one by default), through the
    tracer the app would build from ``tracing.enabled``."""
    started: list[LiveServer] = []

    def make(exporter: SpanExporter | None = None, **overrides: Any) -> Traced:
        if "upstreams" not in overrides:  # one of them (upstream beside upstreams is refused)
            overrides.setdefault("upstream", fake_backend.url + "/v1")
        app = create_app(Settings(**overrides))
        exporter = exporter or InMemorySpanExporter()
        tracer = start_tracing(TracingSettings(enabled=True), exporter=exporter)
        assert tracer is not None
        app.state.proxy.tracing = tracer
        server = LiveServer(app).start()
        started.append(server)
        return Traced(server, exporter, tracer)

    yield make
    for server in started:
        server.stop()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def backend_headers(fake_backend: LiveServer, request_id: str) -> dict[str, str]:
    logged = httpx.get(fake_backend.url + "/fake/requests", params={"limit": 50}).json()
    (record,) = [r for r in logged if r["headers"].get("x-request-id") == request_id]
    headers: dict[str, str] = record["headers"]
    return headers


def traceparent_of(span: ReadableSpan) -> str:
    """The span's trace and span id, as a ``traceparent`` names them (flags aside: the SDK sets the
    random-trace-id flag of Trace Context level 2 next to the sampled one)."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}"


def sent_parent(headers: dict[str, str]) -> str:
    """The ``traceparent`` the backend got, without its flags."""
    return headers["traceparent"].rsplit("-", 1)[0]


def system(date: str) -> dict[str, str]:
    return {"role": "system", "content": f"You are a support agent for ACME.\nToday is {date}.\nBe brief."}


def post_chat(server: LiveServer, messages: list[dict[str, Any]], request_id: str, **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 5}
    return httpx.post(server.url + CHAT_PATH, json=body, headers={"x-request-id": request_id, **headers}, timeout=30)


def test_chat_span_carries_the_access_logs_facts(
    traced_proxy: Callable[..., Traced], fake_backend: LiveServer, access_lines: list[str]
) -> None:
    traced = traced_proxy()
    session = {"x-session-id": "tracing-chat-1"}
    days = ("2024-05-01", "2024-05-02", "2024-05-03")  # the date varies: moved out of the system prompt
    for n, day in enumerate(days, 1):
        response = post_chat(
            traced.server, [system(day), {"role": "user", "content": SECRET}], f"trace-chat-{n}", **session
        )
        assert response.status_code == 200, response.text
    span = traced.span("trace-chat-3")
    got = attrs(span)
    usage = response.json()["usage"]
    (line,) = [json.loads(x) for x in access_lines if "trace-chat-3" in x]

    assert span.kind is SpanKind.SERVER and span.name == "POST /v1/chat/completions"
    assert span.status.status_code is StatusCode.UNSET
    assert got["http.request.method"] == "POST" and got["http.route"] == CHAT_PATH
    assert got["http.response.status_code"] == 200
    assert got["prefix_proxy.route"] == "chat" and got["prefix_proxy.stream"] is False
    assert got["prefix_proxy.tenant"] == "anonymous" == line["tenant"]
    assert got["prefix_proxy.session"] == response.headers["x-prefix-proxy-session"] == line["session"]
    # The date moved out of the system prompt: the canonicalization's actions, as the header has them.
    assert list(got["prefix_proxy.actions"]) == response.headers["x-prefix-proxy-actions"].split(",")
    assert any(a.startswith("volatile_moved") for a in got["prefix_proxy.actions"])
    assert got["prefix_proxy.cache_break"] == response.headers["x-prefix-proxy-cache-break"].split(";")[0]
    assert got["prefix_proxy.cache_break"] == line["cache_break"]["cause"]
    assert got["prefix_proxy.backend"] == backend_name(fake_backend.url + "/v1") == line["backend"]
    assert got["prefix_proxy.model"] == MODEL and got["prefix_proxy.prefix"] == line["prefix"]
    assert got["prefix_proxy.prompt_tokens"] == usage["prompt_tokens"]
    assert got["prefix_proxy.cached_tokens"] == int(response.headers["x-prefix-proxy-cached-tokens"]) > 0
    assert got["prefix_proxy.cached_tokens"] == line["cached_tokens"]
    assert got["prefix_proxy.completion_tokens"] == usage["completion_tokens"]
    assert 0 < got["prefix_proxy.upstream_ttfb_ms"] <= got["prefix_proxy.upstream_ms"]
    assert got["prefix_proxy.upstream_ms"] == line["upstream_ms"]
    assert got["prefix_proxy.overhead_ms"] == line["overhead_ms"]
    assert span.start_time is not None and span.end_time is not None
    assert (span.end_time - span.start_time) / 1e6 >= got["prefix_proxy.upstream_ms"]
    # The backend got the span's context: same trace, the proxy's span its parent.
    sent = backend_headers(fake_backend, "trace-chat-3")
    assert sent_parent(sent) == traceparent_of(span) and int(sent["traceparent"][-2:], 16) & 1  # sampled
    assert span.parent is None


def test_streamed_chat_span(traced_proxy: Callable[..., Traced], fake_backend: LiveServer) -> None:
    traced = traced_proxy()
    response, text = stream_chat(
        traced.server, [{"role": "user", "content": SECRET}], max_tokens=6, headers={"x-request-id": "trace-stream-1"}
    )
    assert response.status_code == 200 and text
    span = traced.span("trace-stream-1")
    got = attrs(span)
    assert got["prefix_proxy.stream"] is True and got["http.response.status_code"] == 200
    assert got["prefix_proxy.completion_tokens"] > 0 and got["prefix_proxy.prompt_tokens"] > 0
    assert "prefix_proxy.cached_tokens" in got
    assert 0 < got["prefix_proxy.upstream_ttfb_ms"] <= got["prefix_proxy.ttft_ms"]
    assert got["prefix_proxy.ttft_ms"] <= got["prefix_proxy.upstream_ms"] + got["prefix_proxy.overhead_ms"] + 50
    assert "prefix_proxy.error" not in got and span.status.status_code is StatusCode.UNSET
    assert sent_parent(backend_headers(fake_backend, "trace-stream-1")) == traceparent_of(span)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_span(
    traced_proxy: Callable[..., Traced], fake_backend: LiveServer, access_lines: list[str], stream: bool
) -> None:
    traced = traced_proxy()
    request_id = f"trace-messages-{stream}"
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "stream": stream,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": SECRET}],
    }
    with httpx.stream(
        "POST", traced.server.url + "/v1/messages", json=body, headers={"x-request-id": request_id}, timeout=30
    ) as response:
        response.read()
    assert response.status_code == 200, response.text
    span = traced.span(request_id)
    got = attrs(span)
    assert span.name == "POST /v1/messages" and got["prefix_proxy.route"] == "messages"
    assert got["prefix_proxy.stream"] is stream and got["http.response.status_code"] == 200
    assert got["prefix_proxy.prompt_tokens"] > 0 and got["prefix_proxy.completion_tokens"] > 0
    assert got["prefix_proxy.cache_break"] == "new_conversation"
    (line,) = [json.loads(x) for x in access_lines if request_id in x]
    assert got["prefix_proxy.prompt_tokens"] == line["prompt_tokens"]
    assert got["prefix_proxy.completion_tokens"] == line["completion_tokens"]
    assert sent_parent(backend_headers(fake_backend, request_id)) == traceparent_of(span)


def test_the_clients_traceparent_is_the_parent(traced_proxy: Callable[..., Traced], fake_backend: LiveServer) -> None:
    traced = traced_proxy()
    response = post_chat(
        traced.server,
        [{"role": "user", "content": "hello"}],
        "trace-parent-1",
        traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        tracestate="vendor=opaque",
    )
    assert response.status_code == 200
    span = traced.span("trace-parent-1")
    assert span.parent is not None and span.parent.is_remote
    assert f"{span.parent.trace_id:032x}" == CLIENT_TRACE and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    assert f"{span.get_span_context().trace_id:032x}" == CLIENT_TRACE
    headers = backend_headers(fake_backend, "trace-parent-1")
    assert sent_parent(headers) == traceparent_of(span)
    assert headers["tracestate"] == "vendor=opaque"


def test_an_unsampled_trace_records_nothing_and_still_propagates(
    traced_proxy: Callable[..., Traced], fake_backend: LiveServer
) -> None:
    traced = traced_proxy()
    response = post_chat(
        traced.server,
        [{"role": "user", "content": "hi"}],
        "trace-unsampled",
        traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00",
    )
    assert response.status_code == 200
    sent = backend_headers(fake_backend, "trace-unsampled")["traceparent"]
    assert sent.startswith(f"00-{CLIENT_TRACE}-") and sent.endswith("-00") and CLIENT_SPAN not in sent
    traced.tracer.provider.force_flush()
    assert isinstance(traced.exporter, InMemorySpanExporter) and not traced.exporter.get_finished_spans()


def test_no_prompt_text_in_any_span_even_when_the_log_has_it(
    traced_proxy: Callable[..., Traced], access_lines: list[str]
) -> None:
    traced = traced_proxy(log_prompts=True)
    messages = [system("2024-06-01"), {"role": "user", "content": SECRET}]
    assert post_chat(traced.server, messages, "trace-secret-1").status_code == 200
    stream_chat(traced.server, messages, headers={"x-request-id": "trace-secret-2"})
    spans = [traced.span("trace-secret-1"), traced.span("trace-secret-2")]
    assert SECRET in "".join(access_lines)  # log_prompts: the log has it; the spans must not
    for span in spans:
        text = span.to_json()
        assert SECRET not in text and "vault" not in text and "ACME" not in text


def test_errors_are_error_spans(traced_proxy: Callable[..., Traced]) -> None:
    traced = traced_proxy(upstream=f"http://127.0.0.1:{free_port()}/v1")  # nobody listens there
    response = post_chat(traced.server, [{"role": "user", "content": "hi"}], "trace-unreachable")
    assert response.status_code == 502
    span = traced.span("trace-unreachable")
    got = attrs(span)
    assert span.status.status_code is StatusCode.ERROR
    assert got["http.response.status_code"] == 502 and got["error.type"] == got["prefix_proxy.error"]

    keyed = traced_proxy(tenants=[{"name": "acme", "api_key": "sk-acme-0123456789"}])
    refused = post_chat(keyed.server, [{"role": "user", "content": "hi"}], "trace-refused")
    assert refused.status_code == 401
    span = keyed.span("trace-refused")
    assert attrs(span)["http.response.status_code"] == 401 and span.status.status_code is StatusCode.UNSET
    answered = post_chat(
        keyed.server, [{"role": "user", "content": "hi"}], "trace-tenant", authorization="Bearer sk-acme-0123456789"
    )
    assert answered.status_code == 200 and attrs(keyed.span("trace-tenant"))["prefix_proxy.tenant"] == "acme"


def test_a_request_resent_in_the_clients_order_is_one_span(traced_proxy: Callable[..., Traced]) -> None:
    """A strict chat template refuses the relocated system message; the proxy resends the request
    (proxy/routes/chat.py): both attempts are the one span's children, and the span ends once."""
    with LiveServer(create_fake_app(FakeBackendConfig(system_anywhere=False))) as strict:
        traced = traced_proxy(upstream=strict.url + "/v1")
        for day, request_id in (("2024-07-01", "trace-strict-1"), ("2024-07-02", "trace-strict-2")):
            response = post_chat(traced.server, [system(day), {"role": "user", "content": "hi"}], request_id)
            assert response.status_code == 200, response.text
        span = traced.span("trace-strict-2")
        logged = httpx.get(strict.url + "/fake/requests").json()
    attempts = [r for r in logged if r["headers"].get("x-request-id") == "trace-strict-2"]
    assert [r["status_code"] for r in attempts] == [400, 200]
    assert {sent_parent(r["headers"]) for r in attempts} == {traceparent_of(span)}
    assert "retried_keeping_message_order" in attrs(span)["prefix_proxy.actions"]
    assert attrs(span)["http.response.status_code"] == 200


def test_a_passed_through_route_is_traced_too(traced_proxy: Callable[..., Traced], fake_backend: LiveServer) -> None:
    traced = traced_proxy()
    response = httpx.post(
        traced.server.url + "/tokenize",
        json={"model": MODEL, "prompt": "hello"},
        headers={"x-request-id": "trace-tokenize"},
    )
    assert response.status_code == 200, response.text
    span = traced.span("trace-tokenize")
    assert span.name == "POST /tokenize" and attrs(span)["prefix_proxy.route"] == "tokenize"
    assert sent_parent(backend_headers(fake_backend, "trace-tokenize")) == traceparent_of(span)


class RaisingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise ConnectionError("collector down")


class HangingExporter(SpanExporter):
    """A collector that does not answer until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS


def test_a_failing_exporter_never_fails_a_request(traced_proxy: Callable[..., Traced]) -> None:
    exporter = RaisingExporter()
    traced = traced_proxy(exporter)
    for n in range(3):
        assert post_chat(traced.server, [{"role": "user", "content": f"hi {n}"}], f"trace-raise-{n}").status_code == 200
        traced.tracer.provider.force_flush()
    assert exporter.calls >= 1  # it was called, it raised, and the SDK kept it to itself
    assert post_chat(traced.server, [{"role": "user", "content": "again"}], "trace-raise-last").status_code == 200


def test_a_hanging_exporter_never_slows_a_request(traced_proxy: Callable[..., Traced]) -> None:
    exporter = HangingExporter()
    traced = traced_proxy(exporter)
    try:
        assert post_chat(traced.server, [{"role": "user", "content": "first"}], "trace-hang-0").status_code == 200
        threading.Thread(target=traced.tracer.provider.force_flush, daemon=True).start()
        assert exporter.entered.wait(10)  # the export is stuck now
        started = time.monotonic()
        for n in range(20):
            assert (
                post_chat(traced.server, [{"role": "user", "content": f"hi {n}"}], f"trace-hang-{n + 1}").status_code
                == 200
            )
        assert time.monotonic() - started < 10
    finally:
        exporter.release.set()


def test_off_by_default_and_nothing_imported() -> None:
    """Without ``tracing.enabled`` the SDK's tracing is never imported (FastAPI and redis import
    OpenTelemetry's API themselves), and a request carries no span."""
    code = """
import sys
import httpx
from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig, create_app as fake
from testbed.serving import LiveServer
with LiveServer(fake(FakeBackendConfig())) as backend:
    app = create_app(Settings(upstream=backend.url + "/v1"))
    assert app.state.proxy.tracing is None
    with LiveServer(app) as proxy:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-request-id": "off-1"})
        assert response.status_code == 200
        sent = httpx.get(backend.url + "/fake/requests").json()[-1]["headers"]
        assert "traceparent" not in sent, sent
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_enabled_without_the_extra_is_one_line_at_start_up(fake_backend: LiveServer) -> None:
    code = (
        "import sys; sys.modules['opentelemetry.sdk.trace'] = None\n"  # as if the extra were not installed
        "from proxy.cli import main\n"
        f"sys.exit(main(['serve', '--upstream', {fake_backend.url + '/v1'!r}, '--port', '{free_port()}']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIX_PROXY_")}
    env["PREFIX_PROXY_TRACING__ENABLED"] = "true"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    # A configuration problem like any other, found as the settings load (check-config finds it too).
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "prefix-proxy: PREFIX_PROXY_TRACING__ENABLED: OpenTelemetry is not installed: "
        "pip install 'prefix-proxy[otel]', or set tracing.enabled false"
    ]


def test_otlp_http_endpoint() -> None:
    assert otlp_http_endpoint(None) is None
    assert otlp_http_endpoint("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_http_endpoint("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert otlp_http_endpoint("https://otel.example/custom/traces") == "https://otel.example/custom/traces"


class OTLPReceiver:
    """A collector's OTLP/HTTP traces endpoint: ``POST /v1/traces``, protobuf decoded."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path != "/v1/traces" or self.headers["content-type"] != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A collector's OTLP/gRPC trace service."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.url = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def received_spans(requests: list[trace_service_pb2.ExportTraceServiceRequest]) -> list[tuple[dict[str, Any], Any]]:
    """(resource attributes, span) of every span received."""
    spans = []
    for request in requests:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                spans.extend((resource, span) for span in scope_spans.spans)
    return spans


def wire_attributes(span: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        values[a.key] = [v.string_value for v in value.values] if kind == "array_value" else value
    return values


@pytest.mark.parametrize("exporter", ["otlp-http", "otlp-grpc"])
def test_spans_reach_a_real_otlp_receiver(fake_backend: LiveServer, exporter: str) -> None:
    receiver = OTLPReceiver() if exporter == "otlp-http" else GrpcReceiver()
    try:
        settings = Settings(
            upstream=fake_backend.url + "/v1",
            tracing={
                "enabled": True,
                "exporter": exporter,
                "endpoint": receiver.url,
                "service_name": "proxy-under-test",
            },
        )
        request_id = f"trace-wire-{exporter}"
        with LiveServer(create_app(settings)) as server:
            assert post_chat(server, [{"role": "user", "content": SECRET}], request_id).status_code == 200
            time.sleep(0.2)  # the whole answer's span ends just after it is sent
        # The app's shutdown exported what was queued.
        ((resource, span),) = [
            (r, s)
            for r, s in received_spans(receiver.requests)
            if wire_attributes(s).get("prefix_proxy.request_id") == request_id
        ]
    finally:
        if isinstance(receiver, OTLPReceiver):
            receiver.close()
        else:
            receiver.server.stop(0)
    assert resource["service.name"] == "proxy-under-test"
    assert span.name == "POST /v1/chat/completions" and span.kind == span.SPAN_KIND_SERVER
    got = wire_attributes(span)
    assert got["prefix_proxy.route"] == "chat" and got["http.response.status_code"] == 200
    assert got["prefix_proxy.backend"] == backend_name(fake_backend.url + "/v1")
    assert got["prefix_proxy.prompt_tokens"] > 0 and "prefix_proxy.cache_break" in got
    assert SECRET not in str(span)
    assert sent_parent(backend_headers(fake_backend, request_id)) == f"00-{span.trace_id.hex()}-{span.span_id.hex()}"
