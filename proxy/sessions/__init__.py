"""Sessions: which conversation a request belongs to, and its record in the store (memory or Redis)."""

from proxy.sessions.connect import RedisClient, client_problem, configured_client, drop_connections, redis_client
from proxy.sessions.identity import conversation_root
from proxy.sessions.keys import slot_tag
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.model import Reservation, SessionRecord, UsageLimit
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.service import SessionService, SessionView, StoreUnavailable
from proxy.sessions.store import SessionStore

__all__ = [
    "MemorySessionStore",
    "RedisClient",
    "RedisSessionStore",
    "Reservation",
    "SessionRecord",
    "SessionService",
    "SessionStore",
    "SessionView",
    "StoreUnavailable",
    "UsageLimit",
    "client_problem",
    "configured_client",
    "conversation_root",
    "drop_connections",
    "redis_client",
    "slot_tag",
]
