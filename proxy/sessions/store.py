"""The session-store interface. Both implementations (memory, Redis) honour the same semantics,
checked by the same behaviour tests (tests/test_session_store.py)."""

from __future__ import annotations

from typing import Any, Protocol

from proxy.sessions.model import Reservation, SessionRecord, TurnRecord, UsageLimit


class SessionStore(Protocol):
    # Operations that never wait on I/O (they cannot stall, so no timeout can fire on them).
    in_process: bool

    async def ping(self) -> bool: ...

    async def get(self, tenant: str, session_id: str) -> SessionRecord | None: ...

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        """Session id per fingerprint (None where unknown) and the candidates' last-seen times."""
        ...

    async def record_turn(self, tenant: str, session_id: str, turn: TurnRecord, now: float) -> None:
        """Add one finished request to a session atomically; refreshes the TTL."""
        ...

    async def list_sessions(self, tenant: str, limit: int = 100) -> list[SessionRecord]: ...

    async def delete(self, tenant: str, session_id: str) -> bool: ...

    async def set_summary(self, tenant: str, session_id: str, summary: dict[str, Any] | None) -> None: ...

    async def reserve(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> Reservation:
        """Atomically admit ``amount`` tokens against every limit, or none of them."""
        ...

    async def settle(self, reservation: Reservation, delta: int, window_s: int) -> None:
        """Correct a reservation by ``delta`` tokens once the real usage is known."""
        ...

    async def charge(self, limits: list[UsageLimit], amount: int, window_s: int, now: float) -> None:
        """Count ``amount`` tokens against every limit without admission: what a request admitted
        unreserved (the store was down) turned out to spend."""
        ...

    async def usage(self, key: str, window_s: int, now: float) -> int: ...

    async def acquire_lock(self, name: str, ttl_s: float) -> str | None: ...

    async def release_lock(self, name: str, token: str) -> None: ...

    async def get_route_headers(self, digest: str) -> dict[str, str] | None:
        """Headers a router asked to be echoed for one routing key (its digest)."""
        ...

    async def set_route_headers(self, digest: str, headers: dict[str, str]) -> None: ...

    async def stats(self, since: float) -> tuple[int, int]:
        """(sessions active since ``since``, their summed context tokens)."""
        ...

    async def reset(self) -> None:
        """Forget connections after a failure (the next operation opens fresh ones)."""
        ...

    async def aclose(self) -> None: ...

    async def put_response(self, tenant: str, response_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Remember where a stored Responses-API response lives (its backend, its chain)."""
        ...

    async def get_response(self, tenant: str, response_id: str) -> dict[str, Any] | None: ...

    async def shared_secret(self, name: str, candidate: str) -> str:
        """The secret every replica sharing this store uses under ``name``: the one stored, else
        ``candidate``, stored now (first writer wins; kept without expiry)."""
        ...


def window_of(now: float, window_s: int) -> tuple[int, int]:
    """(window index, seconds until it ends)."""
    index = int(now // window_s)
    return index, max(1, int((index + 1) * window_s - now + 0.999))
