"""The routing key as request headers, for a router behind the proxy (docs/routing.md).

An external router (vLLM Router, the SGLang Model Gateway, production-stack, llm-d) routes on a
header it is told to read. The proxy sets each configured header on every upstream request to the
request's routing key, the same key its own affinity routes on: one conversation, one value, on
every proxy replica and while the session store is down. The key names a tenant and hashes of the
prompt; it leaves as a digest, so neither reaches the router.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from proxy.config import router_header


def key_digest(key: str) -> str:
    """32 hex digits: stable across replicas and restarts, and nothing of the key recoverable."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class KeyHeaders:
    def __init__(self, names: Sequence[str]) -> None:
        try:
            # The settings' own rule (checked as they load): one reading of a header name.
            self.names = tuple(dict.fromkeys(router_header(name) for name in names))
        except ValueError as error:
            raise ValueError(f"routing.key_headers: {error}") from None

    def apply(self, headers: Mapping[str, str] | None, key: str | None) -> Mapping[str, str] | None:
        """``headers`` plus the key headers (unchanged without a key or without names)."""
        if key is None or not self.names:
            return headers
        value = key_digest(key)
        return {**(headers or {}), **dict.fromkeys(self.names, value)}
