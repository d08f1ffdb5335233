"""Several upstream servers behind one proxy: routing policies, failover and health.

A request's *routing key* (its tenant and session, or its stable prefix) picks the backend
whose prefix cache most likely holds it; a dead backend's requests go to the next one.
"""

from proxy.backends.backend import Backend, backend_name
from proxy.backends.policies import POLICIES, Affinity, LeastInFlight, RoundRobin, RoutingPolicy, make_policy
from proxy.backends.pool import BackendPool

__all__ = [
    "POLICIES",
    "Affinity",
    "Backend",
    "BackendPool",
    "LeastInFlight",
    "RoundRobin",
    "RoutingPolicy",
    "backend_name",
    "make_policy",
]
