"""Tenants: who is calling, keyed by the proxy API key they present.

With no keys configured the proxy is open and every caller is the tenant
``anonymous``. Once keys exist (config file, or Redis when enabled), a request
without a valid key is answered 401. Keys are compared by SHA-256 digest in
constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.config import BudgetOverrides, TenantSettings
from proxy.errors import ProxyError

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Tenant:
    name: str
    upstream_api_key: str | None = None
    budget: BudgetOverrides = field(default_factory=BudgetOverrides)


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


def tenant_cache_salt(tenant: str, client_salt: Any = None) -> str:
    """vLLM's ``cache_salt`` for a tenant: prompts share cached blocks only within one salt, so one
    tenant cannot learn from response times what another has sent (a prefix-cache timing channel).

    A salt the client sent itself is folded in, never passed through alone: no client can choose
    another tenant's salt. BLAKE2, not xxhash, because clients choose part of the input.
    """
    digest = hashlib.blake2b(f"{tenant}\x00{client_salt or ''}".encode("utf-8", "surrogatepass"), digest_size=16)
    return "pp-" + digest.hexdigest()


KeyLookup = Callable[[str], Awaitable[str | None]]


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def unauthorized(message: str = "invalid or missing API key") -> ProxyError:
    return ProxyError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


class TenantDirectory:
    def __init__(
        self,
        tenants: list[TenantSettings],
        redis_lookup: KeyLookup | None = None,
        *,
        isolate_caches: bool = True,
    ) -> None:
        self._isolate_caches = isolate_caches
        self._by_digest = {
            key_digest(t.api_key.get_secret_value()): Tenant(
                t.name, t.upstream_api_key.get_secret_value() if t.upstream_api_key else None, t.budget
            )
            for t in tenants
        }
        self._redis_lookup = redis_lookup
        self._cache: dict[str, tuple[Tenant | None, float]] = {}

    @property
    def open(self) -> bool:
        return not self._by_digest and self._redis_lookup is None

    def cache_salted(self, tenant: Tenant, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the tenant's ``cache_salt`` (see :func:`tenant_cache_salt`); unchanged when the
        proxy is open (one tenant) or isolation is switched off."""
        if self.open or not self._isolate_caches:
            return body
        return {**body, "cache_salt": tenant_cache_salt(tenant.name, body.get("cache_salt"))}

    async def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return ANONYMOUS_TENANT
        token = bearer_token(authorization)
        if token is None:
            raise unauthorized()
        digest = key_digest(token)
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        provisioned = await self._from_redis(digest)
        if provisioned is None:
            raise unauthorized()
        return provisioned

    async def _from_redis(self, digest: str) -> Tenant | None:
        if self._redis_lookup is None:
            return None
        cached = self._cache.get(digest)
        if cached and cached[1] > time.monotonic():
            return cached[0]
        raw = await self._redis_lookup(digest)
        tenant = None
        if raw:
            data = json.loads(raw)
            tenant = Tenant(
                str(data["name"]),
                data.get("upstream_api_key"),
                BudgetOverrides.model_validate(data.get("budget") or {}),
            )
        self._cache[digest] = (tenant, time.monotonic() + 30)
        return tenant
