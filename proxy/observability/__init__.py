"""What the proxy tells operators: metrics, the access log, traces, captures and why a request
missed the prefix cache (the cache-break explanation)."""

from proxy.observability.access_log import configure_logging, log_request
from proxy.observability.apps import AppBook, Totals
from proxy.observability.breaks import CAUSES, NONE, BreakMemory
from proxy.observability.capture import CaptureWriter, arrival, capture_record
from proxy.observability.digests import digest_prompt, message_hash
from proxy.observability.floor import Floor, FloorMeter
from proxy.observability.metrics import Metrics
from proxy.observability.page import CONTENT_SECURITY_POLICY, SessionRow, Snapshot, TenantView, render, tenant_names
from proxy.observability.shadow import RewriteShadow, ShadowSettings
from proxy.observability.tracing import RequestTracer, start_tracing
from proxy.observability.tracker import CacheBreakTracker, PendingBreak, summary_index

__all__ = [
    "CAUSES",
    "CONTENT_SECURITY_POLICY",
    "NONE",
    "AppBook",
    "BreakMemory",
    "CacheBreakTracker",
    "CaptureWriter",
    "Floor",
    "FloorMeter",
    "Metrics",
    "PendingBreak",
    "RequestTracer",
    "RewriteShadow",
    "SessionRow",
    "ShadowSettings",
    "Snapshot",
    "TenantView",
    "Totals",
    "arrival",
    "capture_record",
    "configure_logging",
    "digest_prompt",
    "log_request",
    "message_hash",
    "render",
    "start_tracing",
    "summary_index",
    "tenant_names",
]
