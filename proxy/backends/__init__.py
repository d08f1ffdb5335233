"""Several upstream servers behind one proxy: routing policies, failover and health.

A request's *routing key* (its tenant and session, or its stable prefix) picks the backend
whose prefix cache most likely holds it; a dead backend's requests go to the next one.
"""

from proxy.backends.backend import INVALID_ANSWER, NO_FIRST_TOKEN, STREAM_CUT, Backend, OutlierDetection, backend_name
from proxy.backends.catalog import ModelCatalog, described_context
from proxy.backends.echo import EchoedHeaders
from proxy.backends.engines import (
    GENERIC,
    LLAMA_SERVER,
    OLLAMA,
    OPENAI_LIMIT_FIELDS,
    REFUSAL_STATUSES,
    context_of,
    context_overflow,
    engine_of,
    error_of,
    limit_fields,
    refuses_answer_room,
)
from proxy.backends.policies import POLICIES, Affinity, LeastInFlight, RoundRobin, RoutingPolicy, make_policy
from proxy.backends.pool import BACKEND_EXTENSION, TRIAL_EXTENSION, BackendPool
from proxy.backends.transport import tls_problem
from proxy.backends.upstream import Redactor, Upstream, key_forms, upstream_error_kind

__all__ = [
    "BACKEND_EXTENSION",
    "GENERIC",
    "INVALID_ANSWER",
    "LLAMA_SERVER",
    "NO_FIRST_TOKEN",
    "OLLAMA",
    "OPENAI_LIMIT_FIELDS",
    "POLICIES",
    "REFUSAL_STATUSES",
    "STREAM_CUT",
    "TRIAL_EXTENSION",
    "Affinity",
    "Backend",
    "BackendPool",
    "EchoedHeaders",
    "LeastInFlight",
    "ModelCatalog",
    "OutlierDetection",
    "Redactor",
    "RoundRobin",
    "RoutingPolicy",
    "Upstream",
    "backend_name",
    "context_of",
    "context_overflow",
    "described_context",
    "engine_of",
    "error_of",
    "key_forms",
    "limit_fields",
    "make_policy",
    "refuses_answer_room",
    "tls_problem",
    "upstream_error_kind",
]
