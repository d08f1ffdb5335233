"""Session records and budget decisions, as every store returns them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class SessionRecord:
    tenant: str
    session_id: str
    created: float = 0.0
    last_seen: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens of the latest request as the upstream counted them (ground truth).
    context_tokens: int = 0
    # upstream prompt tokens / request bytes of the latest request: calibrates later estimates.
    tokens_per_byte: float = 0.0
    fingerprints: int = 0
    # The pair the latest reply forms with its request: a continuation of this conversation re-sends it.
    last_pair: int = 0
    # The newest pair of the latest request (its previous message and the new user turn).
    last_request_pair: int = 0
    # The first pair of the latest request: a client whose next request starts elsewhere slides a window.
    first_pair: int = 0
    # The first pair of the request that opened the session (0 for a record from before it was
    # kept): a request that starts there re-sends the conversation from its beginning.
    opening: int = 0
    summary: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TurnRecord:
    """What one finished request adds to its session."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    tokens_per_byte: float
    new_fingerprints: list[int] = field(default_factory=list)
    reply_pair: int = 0
    request_pair: int = 0
    first_pair: int = 0
    # The session's opening (its record's ``opening``, kept once) and its index key
    # (``identity.opening_key``), set to the session: when the request opens the session, or
    # re-sends the opening (which keeps that entry alive). 0: neither.
    opening: int = 0
    opening_key: int = 0
    # A side lane of a named session (a title or tags request, a sub-agent: it shares the session
    # but does not extend its conversation): it counts the tokens and the request, and leaves the
    # conversation's place (pairs, context) and fingerprints as they were.
    side_lane: bool = False


@dataclass(frozen=True)
class UsageLimit:
    key: str
    limit: int
    kind: str  # "session" or "tenant"


@dataclass(frozen=True)
class Reservation:
    admitted: bool
    amount: int = 0
    keys: tuple[str, ...] = ()
    rejected_kind: str | None = None
    retry_after_s: int = 0
    window: int = 0
