"""Tenants: who is calling, keyed by the proxy API key they present.

With no keys configured the proxy is open and every caller is the tenant
``anonymous``. Once keys exist (config file, or Redis when enabled), a request
without a valid key is answered 401. Keys are compared by SHA-256 digest in
constant time and never logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cachetools import LRUCache
from pydantic import ValidationError

from proxy.config import BudgetOverrides, TenantSettings
from proxy.http import ServiceUnavailable, Unauthorized, is_text
from proxy.recent import peek

logger = logging.getLogger("prefix_proxy.tenants")

ANONYMOUS = "anonymous"
# Keys looked up in Redis are remembered this long (a revoked key stops working within it) ...
REDIS_CACHE_TTL_S = 30.0
# ... and this many at most, least recently used out first. Unknown keys are remembered too (so a
# client retrying a bad key costs no Redis round trip), in a map of their own: anyone can send any
# number of them, and they must not push a real tenant's key out (which then, with Redis down,
# could not be told from a bad one).
REDIS_CACHE_MAX_KEYS = 100_000
REDIS_CACHE_MAX_UNKNOWN_KEYS = 10_000


@dataclass(frozen=True)
class Tenant:
    name: str
    upstream_api_key: str | None = None
    budget: BudgetOverrides = field(default_factory=BudgetOverrides)


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


def tenant_cache_salt(secret: bytes, tenant: str, client_salt: Any = None) -> str:
    """vLLM's ``cache_salt`` for a tenant: prompts share cached blocks only within one salt, so one
    tenant cannot learn from response times what another has sent (a prefix-cache timing channel).

    Keyed BLAKE2 (a MAC) with a server secret no tenant knows: without it, a tenant could compute
    another's salt from its name, send it, and probe that tenant's prompts by cache timing. A salt
    the client sent itself is folded in, never passed through alone: no client can choose another
    tenant's salt.
    """
    message = f"{tenant}\x00{client_salt or ''}".encode("utf-8", "surrogatepass")
    return "pp-" + hashlib.blake2b(message, key=secret, digest_size=16).hexdigest()


def salt_key_of(material: bytes) -> bytes:
    """A BLAKE2 key (at most 64 bytes) from a secret of any length: the configured one may be a
    passphrase or 128 hex characters alike."""
    return hashlib.blake2b(material, digest_size=32, person=b"pp-cache-salt").digest()


# The name under which replicas share a generated salt key in the session store.
# Request fields an engine reads that the deployment sets, never a tenant: vLLM's
# ``kv_transfer_params`` and ``ec_transfer_params`` (disaggregated serving: which remote engine's KV or
# encoder-cache blocks an instance reads, by host and block id, so a tenant naming them would read
# another's), its ``priority`` (with priority scheduling, a tenant's place ahead of every other's) and
# llama-server's ``id_slot`` (the slot a request takes, and the conversation held there it evicts),
# and vLLM's ``request_id`` (the engine's name for the request, and on the Responses API the key it
# stores the response and its conversation under: a tenant naming another's response id would
# overwrite that conversation, and be recorded as an owner of the id).
# Dropped from a tenant's requests; the proxy names a slot of its own where it keeps a conversation's.
DEPLOYMENT_FIELDS = frozenset({"kv_transfer_params", "ec_transfer_params", "id_slot", "priority", "request_id"})

SALT_SECRET_NAME = "cache_salt"


class SaltKey:
    """The server secret behind every tenant's cache salt: configured (``cache_salt_secret``), or
    generated once and kept in the session store so that every replica salts alike, or, until the
    store answers, one of this process's own (isolation holds; the cache is split per replica)."""

    def __init__(self, configured: str | None) -> None:
        self.source = "configured" if configured else "process"
        self.secret = salt_key_of(configured.encode()) if configured else secrets.token_bytes(32)
        # Whether what depends on a key of this process's own was told (compaction tokens, once).
        self.told_unshared = False

    @property
    def settled(self) -> bool:
        return self.source != "process"

    def adopt_shared(self, shared_hex: str) -> None:
        try:
            secret = bytes.fromhex(shared_hex)
        except ValueError:
            logger.warning("the shared cache-salt key in the session store is not hex: keeping this replica's own")
            return
        if len(secret) >= 16:
            self.secret, self.source = salt_key_of(secret), "shared"

    @staticmethod
    def candidate() -> str:
        return secrets.token_hex(32)


KeyLookup = Callable[[str], Awaitable[str | None]]


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def directory_unavailable() -> ServiceUnavailable:
    return ServiceUnavailable(
        "API keys cannot be checked right now (the tenant store is unavailable); retry shortly",
        headers={"retry-after": "1"},
    )


class TenantDirectory:
    def __init__(
        self,
        tenants: list[TenantSettings],
        redis_lookup: KeyLookup | None = None,
        *,
        isolate_caches: bool = True,
        salt_key: SaltKey | None = None,
    ) -> None:
        self._isolate_caches = isolate_caches
        # Models whose engine refused a cache_salt (``refuses_salt``); bounded by the models served.
        self._unsalted: set[str] = set()
        self.salt_key = salt_key or SaltKey(None)
        self._redis_lookup = redis_lookup
        # Redis lookups by key digest: (tenant or None for an unknown key, fresh until), known and
        # unknown keys apart, least recently used out. An entry past its time is kept: it answers
        # for a known tenant while Redis is down (a TTL cache would have dropped it).
        self._cache: LRUCache[str, tuple[Tenant | None, float]] = LRUCache(REDIS_CACHE_MAX_KEYS)
        self._unknown: LRUCache[str, tuple[Tenant | None, float]] = LRUCache(REDIS_CACHE_MAX_UNKNOWN_KEYS)
        # The provisioned tenants seen, by name (the latest record of each): the admin API and the
        # operator page name tenants.
        self._provisioned_names: LRUCache[str, Tenant] = LRUCache(REDIS_CACHE_MAX_KEYS)
        self.replace(tenants)

    def replace(self, tenants: list[TenantSettings]) -> None:
        """The configured tenants from now on (a reload): a key removed is refused at its next
        request, one added is accepted (it is no longer remembered as unknown)."""
        self._by_digest = {
            key_digest(t.api_key.get_secret_value()): Tenant(
                t.name, t.upstream_api_key.get_secret_value() if t.upstream_api_key else None, t.budget
            )
            for t in tenants
        }
        self._by_name = {tenant.name: tenant for tenant in self._by_digest.values()}
        self._unknown.clear()

    @property
    def open(self) -> bool:
        return not self._by_digest and self._redis_lookup is None

    @property
    def isolates_caches(self) -> bool:
        """Tenants are told apart and each gets its own ``cache_salt``."""
        return not self.open and self._isolate_caches

    def cache_salted(self, tenant: Tenant, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the tenant's ``cache_salt`` (see :func:`tenant_cache_salt`) and without the
        fields that are the deployment's (:data:`DEPLOYMENT_FIELDS`); unchanged when the proxy is open
        (one tenant), and only those fields dropped when isolation is switched off."""
        if self.open:
            return body
        if any(name in body for name in DEPLOYMENT_FIELDS):
            body = {name: value for name, value in body.items() if name not in DEPLOYMENT_FIELDS}
        if not self._isolate_caches or body.get("model") in self._unsalted:
            return body
        salt = tenant_cache_salt(self.salt_key.secret, tenant.name, body.get("cache_salt"))
        return {**body, "cache_salt": salt}

    def refuses_salt(self, model: str) -> None:
        """The engine serving ``model`` refused a request for its ``cache_salt`` (a vLLM before
        0.6.5, or on its V0 engine): its requests go without one from now on, and the tenants share
        its prefix cache, which a warning says once."""
        if model not in self._unsalted:
            self._unsalted.add(model)
            logger.warning(
                "the engine serving %r refused cache_salt: its requests go without one, so tenants share its "
                "prompt cache (a fast answer tells a tenant another sent the same prefix); one engine per "
                "tenant keeps them apart",
                model,
            )

    def without_deployment_fields(self, body: Any) -> Any:
        """A JSON body forwarded as the client wrote it (embeddings, pooling, scores) without the
        fields that are the deployment's: ``body`` itself where it has none or the proxy is open."""
        if self.open or not isinstance(body, dict) or not any(name in body for name in DEPLOYMENT_FIELDS):
            return body
        return {name: value for name, value in body.items() if name not in DEPLOYMENT_FIELDS}

    async def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return ANONYMOUS_TENANT
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized()
        # Looked up by the key's SHA-256: what a lookup's time could tell is about the digest, which
        # says nothing of a key (a loop of constant-time comparisons cost 0.6 ms at 10,000 tenants).
        digest = key_digest(token)
        tenant = self._by_digest.get(digest)
        if tenant is not None:
            return tenant
        provisioned = await self._from_redis(digest)
        if provisioned is None:
            raise Unauthorized()
        return provisioned

    async def _from_redis(self, digest: str) -> Tenant | None:
        if self._redis_lookup is None:
            return None
        now = time.monotonic()
        cache = self._cache if digest in self._cache else self._unknown
        cached = cache.get(digest)  # a read is a use
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            raw = await self._redis_lookup(digest)
        except Exception as exc:
            # Redis is down: a tenant seen before keeps working on what was known of it; a key
            # never seen cannot be told from a bad one, so the caller is asked to retry (503),
            # neither let in nor told its key is wrong.
            if cached is not None and cached[0] is not None:
                return cached[0]
            logger.warning("tenant lookup failed (%s): answering 503", type(exc).__name__)
            raise directory_unavailable() from None
        tenant = _tenant_record(digest, raw) if raw else None
        (self._unknown if tenant else self._cache).pop(digest, None)
        (self._cache if tenant else self._unknown)[digest] = (tenant, now + REDIS_CACHE_TTL_S)
        if tenant is not None:
            self._provisioned_names[tenant.name] = tenant
        return tenant

    def named(self, name: str) -> Tenant:
        """The tenant called ``name`` as the proxy knows it (its budget overrides among it): a
        configured one, or one provisioned in Redis whose key was seen; else one of that name with
        no overrides (the admin API names tenants, it does not present their keys)."""
        found = self._by_name.get(name) or peek(self._provisioned_names, name)
        return found if found is not None else Tenant(name)


def _tenant_record(digest: str, raw: str) -> Tenant | None:
    """A Redis tenant record (JSON {name, upstream_api_key?, budget?}); None, with a warning for the
    operator, when it is malformed: the key is then refused like an unknown one."""
    try:
        data = json.loads(raw)
        name = data["name"]
        upstream_key = data.get("upstream_api_key")
        if not is_text(name) or not name or not (upstream_key is None or is_text(upstream_key)):
            raise TypeError("name must be a non-empty string, upstream_api_key a string")
        return Tenant(name, upstream_key, BudgetOverrides.model_validate(data.get("budget") or {}))
    except (ValueError, TypeError, KeyError, AttributeError, ValidationError) as exc:
        logger.warning("malformed tenant record tenant:%s… (%s): key refused", digest[:12], type(exc).__name__)
        return None
