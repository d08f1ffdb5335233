"""The compaction token: a summary the proxy made, handed to the client to send back.

A client that asks the proxy to compact (Responses' ``compaction_trigger`` and
``/v1/responses/compact``, Anthropic's ``compaction`` parameter) gets an opaque item back, which it
sends again on its next requests in place of the history it stands for. The token is the whole
summary, so nothing needs to be found again: a restart, another replica or a store outage never
loses the client's history.

A compaction the client asked for past a threshold (``context_management``) also holds the turn
it kept whole, as the client sent it: the hosted APIs drop what comes before the latest compaction
item, the client's own last turn included, so the item carries it (``Handoff.kept``).

Opaque, not secret: the summary is compressed, not encrypted (whoever holds the token can read
it, as the client that got it already can). What the token is bound to is its tenant: an HMAC
over it, keyed by the proxy's secret and the tenant's name, so a token of another tenant, or one
altered, does not unseal. Pure: no I/O.

    pp1.<base64url(zlib(json))>.<base64url(HMAC-SHA256)>
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import zlib
from typing import Any, NamedTuple

VERSION = "pp1"
# A summary is a few thousand tokens at most, a kept turn what a request carries (images as data
# URLs included); anything that inflates past this is not one of ours.
MAX_PAYLOAD_BYTES = 32 << 20
_SEPARATOR = "."


def _key(secret: bytes, tenant: str) -> bytes:
    return hmac.new(secret, b"compaction\x1f" + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


def _mac(secret: bytes, tenant: str, signed: str) -> str:
    digest = hmac.new(_key(secret, tenant), signed.encode("ascii"), hashlib.sha256).digest()
    return _b64(digest)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Handoff(NamedTuple):
    """What a token holds."""

    summary: str
    # Its length in tokens, as the backend counted it.
    tokens: int
    # The items (messages) after the summarized history, as the client sent them, for a compaction
    # made past a threshold; None for one the client asked for on its own (it keeps what it keeps).
    kept: list[Any] | None = None


def seal(secret: bytes, tenant: str, summary: str, tokens: int, kept: list[Any] | None = None) -> str:
    """The token of ``summary`` (``tokens``: its length in tokens, as the backend counted it) for
    ``tenant``, with the ``kept`` items after it. Deterministic: the same summary and items seal to
    the same token."""
    fields: dict[str, Any] = {"s": summary, "t": int(tokens)}
    if kept is not None:
        fields["k"] = kept
    payload = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    body = _b64(zlib.compress(payload.encode("utf-8", "surrogatepass"), 9))
    signed = f"{VERSION}{_SEPARATOR}{body}"
    return f"{signed}{_SEPARATOR}{_mac(secret, tenant, signed)}"


def unseal(secret: bytes, tenant: str, token: object) -> Handoff | None:
    """What a token sealed for ``tenant`` with ``secret`` holds; None for anything else (another
    tenant's, altered, truncated, another version, not a string)."""
    if not isinstance(token, str) or not token.isascii():
        return None
    parts = token.split(_SEPARATOR)
    if len(parts) != 3 or parts[0] != VERSION:
        return None
    signed = f"{parts[0]}{_SEPARATOR}{parts[1]}"
    if not hmac.compare_digest(_mac(secret, tenant, signed), parts[2]):
        return None
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(_unb64(parts[1]), MAX_PAYLOAD_BYTES)
        if inflater.unconsumed_tail:
            return None
        data = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (ValueError, zlib.error, binascii.Error, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    summary, tokens, kept = data.get("s"), data.get("t"), data.get("k")
    if not isinstance(summary, str) or not isinstance(tokens, int) or isinstance(tokens, bool):
        return None
    if kept is not None and not isinstance(kept, list):
        return None
    return Handoff(summary, tokens, kept)
