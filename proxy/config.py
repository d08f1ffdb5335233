"""Configuration: CLI flags > environment (PREFIX_PROXY_*) > config file (YAML/TOML) > defaults.

Strict: an unknown key anywhere (file, ``PREFIX_PROXY_*`` variable) is an error, and every problem
is reported as one line naming its source (:mod:`proxy.config_sources`)."""

from __future__ import annotations

import errno
import importlib
import ipaddress
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)
from redis.connection import parse_url as parse_redis_url

from proxy.config_sources import (
    SETTING_CONFLICT,
    ConfigError,
    Sources,
    effective,
    explain,
    explain_settings_error,
    read_config_file,
    service_links,
)

ENV_PREFIX = "PREFIX_PROXY_"
CONFIG_FILE_ENV = f"{ENV_PREFIX}CONFIG"

CanonMode = Literal["off", "safe", "relocate"]


def _mode_from_yaml(value: Any) -> Any:
    """YAML 1.1 reads an unquoted ``off`` (and ``no``, ``false``) as false: that is the mode "off".
    ``on``/``yes``/``true`` name no mode."""
    if value is False:
        return "off"
    if value is True:
        raise ValueError("true is not a mode (YAML reads on/yes/true as true): write relocate, safe or off")
    return value


ModeSetting = Annotated[CanonMode, BeforeValidator(_mode_from_yaml)]


# -- values checked as settings load: `check-config` and `serve` run the same checks, before any
# socket is bound, so a value that could only fail at start-up (or at the first request) fails here,
# in one line naming its source (proxy.config_sources.explain).

# A share of a budget or a threshold: 0 would never trigger, above 1 never be reached.
Ratio = Annotated[float, Field(gt=0, le=1)]


def conflict(loc: tuple[str | int, ...], message: str) -> PydanticCustomError:
    """A problem found by looking at several settings together, told at the setting ``loc`` (relative
    to the model whose validator raises it)."""
    return PydanticCustomError(SETTING_CONFLICT, "{message}", {"message": message, "loc": loc})


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError("a port is a number from 1 to 65535")
    if _needs_privilege(value):
        raise ValueError(
            f"port {value} needs the privilege to bind low ports (CAP_NET_BIND_SERVICE), which this process "
            "lacks: choose a port of 1024 or above (8080 is the default), or grant the capability"
        )
    return value


# Linux: the first port any process may bind, and the capability that binds below it.
UNPRIVILEGED_PORT_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")
PROCESS_STATUS = Path("/proc/self/status")
CAP_NET_BIND_SERVICE = 10


def _needs_privilege(port: int) -> bool:
    """Whether binding ``port`` here needs a capability this process does not hold (Linux; False where
    /proc does not say)."""
    try:
        start = int(UNPRIVILEGED_PORT_START.read_text())
        status = PROCESS_STATUS.read_text()
    except (OSError, ValueError):
        return False
    if port >= start:
        return False
    effective = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), None)
    return effective is not None and not int(effective, 16) >> CAP_NET_BIND_SERVICE & 1


Port = Annotated[int, AfterValidator(_port)]

# Addresses every machine can listen on: not probed.
ALWAYS_BINDABLE = frozenset({"0.0.0.0", "127.0.0.1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


def _listen_host(value: str) -> str:
    """An address this machine can listen on: an IP address of one of its interfaces, a wildcard
    (0.0.0.0, ::) or a name that resolves to one. Probed by binding port 0 (any free port), as the
    server would bind its own port."""
    hint = "listen on 0.0.0.0 (every interface) or 127.0.0.1 (this machine only)"
    if not value or value != value.strip():
        raise ValueError(f"not an address: {hint}")
    if value in ALWAYS_BINDABLE:
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if re.fullmatch(r"[0-9.]+", value) or ":" in value:
            raise ValueError(f"not an IP address (an IPv4 address is four numbers from 0 to 255): {hint}") from None
    try:
        bound_socket(value, 0).close()
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"no address has this name here: {hint}") from None
    except OSError as error:
        raise ValueError(f"not an address of this machine ({error.strerror or error}): {hint}") from None
    return value


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port``: the host's addresses as ``getaddrinfo`` gives them
    (every family: a name that has an IPv6 address only, as in an IPv6-only cluster), IPv4 first
    (``localhost`` is 127.0.0.1, as uvicorn binds it). What the settings' check probes (port 0) and
    ``serve`` listens on are bound by this one function. Raises ``socket.gaierror`` (or
    ``UnicodeError``) for a name that does not resolve, and the telling ``OSError`` where no address
    binds (an address in use, where one was)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    failure: OSError | None = None
    for family, kind, protocol, _, address in sorted(found, key=lambda entry: entry[0] != socket.AF_INET):
        sock = socket.socket(family, kind, protocol)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            sock.close()
            failure = failure if failure is not None and failure.errno == errno.EADDRINUSE else error
            continue
        return sock
    assert failure is not None  # getaddrinfo answers at least one address or raises
    raise failure


ListenHost = Annotated[str, AfterValidator(_listen_host)]


def _addresses_of(host: str) -> set[str]:
    """The addresses a listening host names (``localhost`` and ``127.0.0.1`` are one)."""
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return {host}
    return {str(address[0]) for *_, address in found} | {host}


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _key_problem(text: str) -> str | None:
    """Why a key sent as ``Authorization: Bearer KEY`` could not be: HTTP carries visible ASCII (a
    space inside), and drops spaces at either end."""
    if text != text.strip():
        return "starts or ends with a space, which HTTP drops before the key is compared: remove it"
    if not all(" " <= c <= "~" for c in text):
        return "holds a character an HTTP header cannot carry (a line break, a control or non-ASCII character)"
    return None


def _sendable_key(value: SecretStr | None) -> SecretStr | None:
    """A key the proxy sends (upstream) or a client presents (admin, metrics); empty is allowed where
    the setting gives it a meaning (no key)."""
    if value is not None:
        why = _key_problem(value.get_secret_value())
        if why:
            raise ValueError(f"a key is sent in an HTTP header (Authorization: Bearer KEY), and this one {why}")
    return value


HeaderKey = Annotated[SecretStr, AfterValidator(_sendable_key)]


def _client_key(value: SecretStr) -> SecretStr:
    """A tenant's key: what its clients present, so not empty."""
    if not value.get_secret_value():
        raise ValueError("empty: no client can present it; give the tenant a key")
    return _sendable_key(value) or value


# Headers the proxy sets on every upstream request itself, and the hop-by-hop ones (RFC 9110 7.6.1)
# that frame one connection: a router's header written into one would replace the proxy's own, break
# the request's framing, or never reach the router.
PROXY_REQUEST_HEADERS = frozenset({"authorization", "content-type", "content-length", "host", "x-request-id"})
HOP_BY_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
_HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def router_header(name: str) -> str:
    """A header a router behind the proxy reads (``routing.key_headers``, ``routing.echo_headers``),
    lower-cased; ValueError saying why ``name`` cannot be one."""
    lowered = name.strip().lower()
    if not _HEADER_TOKEN.fullmatch(lowered):
        raise ValueError(f"{name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~ only)")
    if lowered in PROXY_REQUEST_HEADERS:
        raise ValueError(
            f"{lowered!r} is a header the proxy sets itself: name the router's own, e.g. x-smg-routing-key"
        )
    if lowered in HOP_BY_HOP_HEADERS:
        raise ValueError(
            f"{lowered!r} is a hop-by-hop header (RFC 9110), which breaks the request or never reaches the router: "
            "name the router's own, e.g. x-smg-routing-key"
        )
    return lowered


def _router_headers(value: list[str]) -> list[str]:
    for index, name in enumerate(value):
        try:
            router_header(name)
        except ValueError as error:
            raise conflict((index,), str(error)) from None
    return value


def sentinel_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` of a Redis sentinel."""
    text = address.strip()
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs brackets, or its last group reads as the port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"a sentinel address is host:port or [ipv6]:port (Sentinel listens on 26379 by default), not {address!r}"
        )
    return host, int(port)


OTEL_INSTALL_HINT = "pip install 'prefix-proxy[otel]'"
# What each tracing exporter imports (proxy.observability.tracing.build_exporter).
OTEL_EXPORTER_MODULES = {
    "otlp-http": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "otlp-grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "console": "opentelemetry.sdk.trace.export",
}


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# No setting means infinity or an astronomical number, and the libraries under the proxy overflow on
# one (a socket timeout past 2**63 nanoseconds, a deque past 2**63 entries): every number a setting
# holds is finite (allow_inf_nan), every duration (a setting named *_s) at most MAX_SECONDS, every
# integer at most MAX_INTEGER.
MAX_SECONDS = 1_000_000_000  # about 31 years
MAX_INTEGER = 2**53 - 1  # the largest integer JSON carries exactly


def _within_reach(value: Any, info: ValidationInfo) -> Any:
    """Every field's value (a wildcard validator of each section): see :data:`MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if (info.field_name or "").endswith("_s") and value > MAX_SECONDS:
        raise ValueError(f"a duration is at most {MAX_SECONDS} seconds (about 31 years)")
    if isinstance(value, int) and abs(value) > MAX_INTEGER:
        raise ValueError(f"input should be at most {MAX_INTEGER} (the largest integer JSON carries exactly)")
    return value


class Section(BaseModel):
    """A settings section: a key it does not know is an error (a misspelling must not run on defaults)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    _within_reach = field_validator("*")(_within_reach)


# The built-in volatile-span detectors (proxy.canon.volatile.BUILTIN_DETECTORS).
DetectorName = Literal["context_block", "datetime", "weekday", "uuid", "request_id", "environment"]

SESSION_HEADERS = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-openwebui-chat-id",
    "x-opencode-session",
    "x-dynamo-session-id",
)
RelocateTarget = Literal["before_last_user", "after_last_user", "system_end"]


class VolatileRule(Section):
    """A user rule that marks spans of system prompts as volatile."""

    name: str
    pattern: str | None = None
    start_marker: str | None = None
    end_marker: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        """Compiled as the detector compiles it (proxy.canon.volatile.regex_detector)."""
        if value is not None:
            try:
                re.compile(value, re.MULTILINE)
            except re.error as error:
                raise ValueError(f"not a regular expression: {error.msg} at position {error.pos}") from None
            except (OverflowError, RecursionError) as error:  # a{99999999999}; thousands of nested groups
                raise ValueError(f"not a regular expression Python can compile: {error}") from None
        return value

    @model_validator(mode="after")
    def _marks_something(self) -> VolatileRule:
        if bool(self.start_marker) != bool(self.end_marker):
            given, missing = ("start_marker", "end_marker") if self.start_marker else ("end_marker", "start_marker")
            raise conflict((missing,), f"rule {self.name!r} has a {given} but no {missing}: a marker rule needs both")
        if not self.pattern and not self.start_marker:
            raise ValueError(
                f"rule {self.name!r} has neither a pattern nor start_marker and end_marker, so it marks nothing: "
                "give a pattern (a regular expression) or both markers"
            )
        return self


class ShadowSection(Section):
    """The shadow (docs/canonicalization.md): per app, the prefill of the requests as sent beside
    that of the requests as forwarded; an app whose rewrites cost more over ``window`` requests is
    forwarded as sent for ``backoff_requests`` (doubling per lost trial), then rewritten again."""

    enabled: bool = True
    window: int = Field(8, ge=1)
    backoff_requests: int = Field(8, ge=1)
    max_backoff_requests: int = Field(1024, ge=1)
    max_apps: int = Field(256, ge=1)
    # Chain links each arrangement of an app remembers (about 100 bytes each).
    max_links: int = Field(4096, ge=2)


class CanonSettings(Section):
    mode: ModeSetting = "relocate"
    relocate_target: RelocateTarget = "before_last_user"
    # Opt-in: re-format client text the backend has not seen (trailing blanks, CRLF; Unicode NFC).
    # It changes the bytes the model is told; see docs/canonicalization.md.
    normalize_whitespace: bool = False
    normalize_unicode: bool = False
    # A detected span moves only once its place was seen with another value (false: at first sight).
    move_only_varying: bool = True
    # Remember where each conversation's block went, so an unchanged block stays there.
    remember_layouts: bool = True
    layout_memory_entries: int = Field(200_000, gt=0)
    learn_volatility: bool = True
    # A moved block that is only a template around the user's message (Dify's {{#sys.query#}}) is
    # re-created in front of earlier user messages, so each turn extends the previous one.
    restore_query_blocks: bool = True
    learned_apps_max: int = Field(1024, ge=0)
    learned_history: int = Field(8, ge=0)
    # Lines of system prompts whose analysis is kept (what a prompt seen before costs: a lookup);
    # 0: every prompt is read line by line each time. Only saves work; the outcome is the same.
    text_memory_lines: int = Field(100_000, ge=0)
    rules: list[VolatileRule] = Field(default_factory=list)
    builtin_detectors: list[DetectorName] = Field(default_factory=lambda: list(get_args(DetectorName)))
    # Per-model overrides of the mode, e.g. {"my-model": "safe"}.
    model_modes: dict[str, ModeSetting] = Field(default_factory=dict)
    shadow: ShadowSection = Field(default_factory=ShadowSection)


def _string_list(value: Any) -> Any:
    """A list from the environment: JSON (``["a", "b"]``) or comma-separated (``a,b``)."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else [u for u in text.split(",") if u.strip()]
    if isinstance(value, list):
        return [str(u).strip() for u in value]
    return value


class BudgetSettings(Section):
    """Token budgets. Unset limits mean unlimited; see docs/sessions.md for the semantics."""

    # Context budget per request; default: the model's max_model_len minus the request's max_tokens.
    context_limit_tokens: int | None = Field(None, gt=0)
    # Fraction of the context budget at which a session becomes due for compaction.
    soft_ratio: Ratio = 0.75
    session_tokens_per_window: int | None = Field(None, gt=0)
    tenant_tokens_per_window: int | None = Field(None, gt=0)
    window_s: int = Field(3600, gt=0)
    # Completion tokens reserved for a request without max_tokens while it is in flight.
    completion_reserve_tokens: int = Field(512, ge=0)
    # Near a limit, ask the backend's POST /tokenize (vLLM) for the exact count instead of estimating
    # (an engine that does not answer within 5 s leaves the estimate in place).
    exact_counts_via_tokenize: bool = False


class BudgetOverrides(Section):
    """A tenant's or a model's budget: what it sets replaces the global value, within the same bounds."""

    context_limit_tokens: int | None = Field(None, gt=0)
    soft_ratio: Ratio | None = None
    session_tokens_per_window: int | None = Field(None, gt=0)
    tenant_tokens_per_window: int | None = Field(None, gt=0)
    window_s: int | None = Field(None, gt=0)
    completion_reserve_tokens: int | None = Field(None, ge=0)
    exact_counts_via_tokenize: bool | None = None

    def apply_to(self, base: BudgetSettings) -> BudgetSettings:
        return base.model_copy(update=self.model_dump(exclude_none=True))


class TenantSettings(Section):
    name: str = Field(min_length=1)
    api_key: Annotated[SecretStr, AfterValidator(_client_key)]
    upstream_api_key: HeaderKey | None = None
    budget: BudgetOverrides = Field(default_factory=BudgetOverrides)


class SessionSettings(Section):
    store: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Sentinel ("host:port" each): the master named redis_sentinel_service is found through
    # them, and followed across failovers; redis_url then gives only db, credentials and TLS.
    redis_sentinels: Annotated[list[str], NoDecode] = Field(default_factory=list)
    redis_sentinel_service: str = "mymaster"
    # For sentinels that require a password of their own (requirepass on the sentinels).
    redis_sentinel_password: SecretStr | None = None
    # Redis Cluster: redis_url names any node (a seed; the others are discovered); keys that one
    # script or transaction touches together share a hash tag (docs/sessions.md).
    redis_cluster: bool = False
    key_prefix: str = "prefix-proxy:"
    ttl_s: int = Field(7 * 24 * 3600, gt=0)
    # Explicit session ids: the first of these headers a request carries (what clients send: a
    # generic header, Claude Code >= 2.1.86, Codex CLI, Open WebUI with ENABLE_FORWARD_USER_INFO_HEADERS,
    # opencode, NVIDIA Dynamo), then the body's prompt_cache_key, then (if enabled) user.
    headers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(SESSION_HEADERS))
    use_prompt_cache_key: bool = True
    use_user: bool = False
    # How long a Redis failure keeps the proxy in pass-through before it tries Redis again.
    retry_after_failure_s: float = Field(1.0, ge=0)
    # The deadline of every socket operation on the store (a Redis that stalls is taken for down
    # within it); a whole store call, connecting and one retry included, gets four of it.
    operation_timeout_s: float = Field(0.5, gt=0)
    # Sessions this replica keeps a copy of (record, summary, fingerprints), least recently used
    # out first, to serve them while the shared store cannot answer (0: none).
    local_copy_sessions: int = Field(10_000, ge=0)
    # Look up API keys in Redis too (hash <prefix>tenant:<sha256(key)> with name, budget JSON).
    tenants_in_redis: bool = False
    # Replaced by readiness.require_store (its opposite), which the default now leaves false:
    # still read, so that configs that set it load (check-config notes it).
    ready_when_store_down: bool | None = None

    _split_sentinels = field_validator("redis_sentinels", mode="before")(_string_list)
    _split_headers = field_validator("headers", mode="before")(_string_list)

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, value: list[str]) -> list[str]:
        for address in value:
            sentinel_address(address)
        return value

    @model_validator(mode="after")
    def _one_topology(self) -> SessionSettings:
        if self.redis_cluster and self.redis_sentinels:
            raise conflict(
                ("redis_cluster",),
                "redis_cluster and redis_sentinels exclude each other (a Redis Cluster has no sentinels): set one",
            )
        if self.redis_sentinels and self.redis_url.startswith("unix:"):
            raise conflict(
                ("redis_url",),
                "a unix:// URL cannot be combined with redis_sentinels (the sentinels name the master's host): "
                "write redis://[:PASSWORD@]ANYHOST/DB",
            )
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        """What redis-py accepts (``redis.connection.parse_url``), checked now rather than at the
        first request."""
        try:
            parts = urlsplit(value)
        except ValueError:  # an unclosed [ (an IPv6 address)
            raise ValueError("not a URL: write an IPv6 host in brackets, redis://[::1]:6379/0") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("a Redis URL starts with redis://, rediss:// or unix://, e.g. redis://HOST:6379/0")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("a Redis URL names its host, e.g. redis://HOST:6379/0")
        try:
            parts.port  # noqa: B018 (parsing it is the check)
        except ValueError:
            raise ValueError("the port of a Redis URL must be a number from 0 to 65535") from None
        database = parts.path.lstrip("/")
        if parts.scheme != "unix" and database and not database.isdigit():
            raise ValueError("the path of a Redis URL is the database number, e.g. redis://HOST:6379/0")
        try:
            parse_redis_url(value)  # its query's options, as redis-py reads them when it connects
        except ValueError as error:
            raise ValueError(f"{str(error).rstrip('.')}: fix or remove that option of the URL's query") from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _single_header(cls, data: Any) -> Any:
        """``header: NAME`` (one header, the earlier setting) goes first in ``headers``."""
        if isinstance(data, dict) and data.get("header"):
            data = dict(data)
            first = data.pop("header")
            if not isinstance(first, str):
                raise ValueError("header: one header name, e.g. x-session-id (several go in headers, a list)")
            rest = _string_list(data.get("headers")) if data.get("headers") is not None else list(SESSION_HEADERS)
            if isinstance(rest, list):
                data["headers"] = [first, *(h for h in rest if h.lower() != first.lower())]
        return data

    @field_validator("headers")
    @classmethod
    def _header_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _HEADER_TOKEN.fullmatch(name):
                raise ValueError(f"{name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~ only)")
        return value


WindowRepair = Literal["off", "named", "inferred"]


class SummarizerSettings(Section):
    enabled: bool = True
    keep_last_turns: int = Field(4, ge=0)
    max_summary_tokens: int = Field(512, gt=0)
    # None: summarize with the conversation's own model (its cached prefix is on that model).
    model: str | None = None
    instruction: str | None = None
    timeout_s: float = Field(60.0, gt=0)
    lock_ttl_s: float = Field(120.0, gt=0)
    retry_backoff_s: float = Field(30.0, ge=0)
    # A ready summary replaces the history it covers only once the request without it would pass
    # this share of the context budget (1: only when it would not fit at all): swapping it in costs
    # one recompute of the turns after it, which a direct connection never pays. Lower applies it
    # sooner (fewer tokens per request and less KV memory per session, for that recompute).
    apply_ratio: float = Field(1.0, ge=0, le=1)
    # Past the soft threshold, a summary is computed ahead only if the conversation, growing as its
    # latest request did, would reach the point where it is used (apply_ratio) within this many
    # requests: a summary that is never used is a request a direct connection never makes. 0: at
    # the soft threshold whatever the growth.
    lookahead_requests: int = Field(4, ge=0)
    # Restore messages a client's sliding window dropped, until they are folded into the summary:
    # "inferred" (default): in inferred sessions too, where the window re-sends replies the backend
    # generated for the conversation, and never where the request starts with a conversation
    # opening the proxy saw open in another session (deterministic replies can make a conversation's
    # whole history equal the end of another's; docs/summarizer.md); "named": only in sessions the
    # client names (a session header, prompt_cache_key), whose identity is certain; "off".
    # true / false mean "named" / "off".
    sliding_window_repair: WindowRepair = "inferred"
    repair_max_tokens: int = Field(4096, gt=0)

    @field_validator("sliding_window_repair", mode="before")
    @classmethod
    def _repair_from_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "named" if value else "off"
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return "named" if value.strip().lower() == "true" else "off"
        return value


RoutingPolicyName = Literal["affinity", "least_in_flight", "round_robin"]


MIN_HEALTH_CHECK_INTERVAL_S = 0.1


class RoutingSettings(Section):
    """How requests are spread over several upstreams (``upstreams``); see docs/routing.md."""

    # affinity: a conversation (or, without a session, an app's stable prefix) sticks to one backend,
    # whose prefix cache holds it; least_in_flight / round_robin: even load, no cache locality.
    policy: RoutingPolicyName = "affinity"
    # Affinity yields to the next backend once its own carries this many times the average load.
    balance_factor: float = Field(2.0, ge=1.0)
    # Active checks (GET /models on every backend, the first at start) eject a backend that is down or
    # does not serve the API at its URL, re-admit ejected backends and learn their models; 0 leaves
    # only passive ejection on failures.
    health_check_interval_s: float = Field(5.0, ge=0)
    # Outlier detection (passive health; proxy.backends.backend.OutlierDetection, whose defaults
    # these are): this many 5xx/429 answers in a row eject a backend (502/503/504, a Retry-After,
    # or an unreachable backend eject at once), for base_ejection_s doubling with each recent
    # ejection up to max_ejection_s, or as long as a Retry-After asks, up to max_retry_after_s
    # (0: not honoured). An ejected backend rejoins when a trial request succeeds.
    consecutive_failures: int = Field(3, ge=1)
    base_ejection_s: float = Field(1.0, gt=0)
    max_ejection_s: float = Field(30.0, gt=0)
    max_retry_after_s: float = Field(60.0, ge=0)
    # A request answered 5xx/429 before anything reached the client is sent to up to this many
    # other backends in service; 0: the first answer is the client's.
    max_retries: int = Field(2, ge=0)
    # With several backends: a generation request whose first token (a stream's first event, a
    # whole answer's headers) has not come after this long has its engine checked (GET /health,
    # 3 s; GET /models where the server has no /health); one that does not answer is hung:
    # ejected, and the request sent to the next backend while nothing reached the client. One that
    # answers is slow, not hung: waited for, up to upstream_timeout_s. 0: off.
    first_token_timeout_s: float = Field(30.0, ge=0)
    # A router behind the proxy (vLLM Router, SGLang Model Gateway, production-stack): each of these
    # headers carries the request's routing key (a digest) on every upstream request, so the router
    # keeps a conversation where its prefix is cached (docs/routing.md). Empty: none sent.
    key_headers: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Response headers a router sets for the client to send back (llm-d: x-session-token): the
    # proxy keeps them per routing key in the session store and sends them on the next request.
    echo_headers: Annotated[list[str], NoDecode] = Field(default_factory=list)

    _split_key_headers = field_validator("key_headers", "echo_headers", mode="before")(_string_list)
    _header_names = field_validator("key_headers", "echo_headers")(_router_headers)

    @field_validator("health_check_interval_s")
    @classmethod
    def _checkable(cls, value: float) -> float:
        """Checks run one round after another: more often than this they would take a backend's time
        (and the proxy's) for nothing."""
        if 0 < value < MIN_HEALTH_CHECK_INTERVAL_S:
            raise ValueError(
                f"below {MIN_HEALTH_CHECK_INTERVAL_S} s the checks would keep every backend busy answering them: "
                f"give at least {MIN_HEALTH_CHECK_INTERVAL_S} (5 is the default), or 0 to turn active checks off"
            )
        return value


class ReplicaSettings(Section):
    """Several proxy replicas behind a load balancer (docs/routing.md, "Replicas that agree")."""

    # Share what each replica's canonicalizer learns (volatile lines, places that vary, where each
    # conversation's lines went, relayed tool calls, strict-template models) through the Redis
    # session store, so every replica canonicalizes as one would. Needs sessions.store: redis.
    share_memories: bool = False
    # The shared stream keeps at most this many batches, and expires this long after the last write.
    max_entries: int = Field(100_000, gt=0)
    ttl_s: int = Field(7 * 24 * 3600, gt=0)
    # Batches a starting replica reads first (what the others learned before it came up).
    warm_entries: int = Field(10_000, ge=0)


class CacheBreakSettings(Section):
    """Per-request miss explanation (docs/analysis.md): hashes of forwarded prompts, no text."""

    enabled: bool = True
    # The backend's KV block size (vLLM: --block-size, 16 by default): expected hits are whole blocks.
    block_size: int = Field(16, gt=0)
    # Forwarded prompts remembered (least recently used out); about 1 KiB each plus 16 bytes a message.
    memory_prompts: int = Field(20_000, gt=0)


class CaptureSettings(Section):
    """Shadow capture of client requests and backend answers, for ``prefix-proxy analyze``.

    Off unless ``path`` is set. The file holds prompt text: it is created with mode 0600.
    """

    path: str | None = None
    # Rotation: past this size the file becomes FILE.1 (FILE.1 becomes FILE.2, ...).
    max_bytes: int = Field(256 * 1024 * 1024, gt=0)
    backups: int = Field(3, ge=0)

    @field_validator("path")
    @classmethod
    def _in_a_folder(cls, value: str | None) -> str | None:
        """The file holds prompts: written only where the operator made room for it (a mistyped
        folder is not created)."""
        if not value:
            return value
        path = Path(value).expanduser()
        if path.is_dir():
            raise ValueError("is a folder: give the path of a file in it, e.g. FOLDER/capture.jsonl")
        if not path.parent.is_dir():
            raise ValueError(
                f"the folder {str(path.parent)!r} does not exist: create it, or give a file in one that does"
            )
        why = _unwritable(path)
        if why:
            raise ValueError(f"cannot be written ({why}): give a file in a folder this user can write")
        return str(path)  # ``~`` expanded: where the writer writes is the file checked here


def _unwritable(path: Path) -> str:
    """Why ``path`` cannot be opened to append to ("" where it can): the file opened as the writer
    opens it, or where it does not exist yet a file made beside it and removed (a read-only
    filesystem, a folder of another user, /sys or /proc say so only then)."""
    try:
        if path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:
            descriptor, probe = tempfile.mkstemp(dir=path.parent, prefix=".prefix-proxy-probe-")
            os.close(descriptor)
            os.unlink(probe)
    except OSError as error:
        return error.strerror or str(error)
    return ""


# vLLM 0.32 routes that change or expose the engine (vllm/entrypoints/serve/dev, rl, lora, profile,
# elastic_ep, fault_tolerance): an operator's, never a tenant's.
DEFAULT_ADMIN_ROUTES = [
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/release_kv_cache_memory",
    "/collective_rpc",
    "/server_info",
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/inference/v1/abort_requests",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/finish_weight_update",
    "/start_draft_weight_update",
    "/shutdown_weight_transfer_engine",
    "/update_weight_version",
    "/weight_checker",
    "/weight_info",
    "/get_world_size",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/fault_tolerance/*",
    "/kv_event_sources",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    # llama.cpp's llama-server (tools/server): the slots list every conversation's size and state
    # (with LLAMA_SERVER_SLOTS_DEBUG, its prompt text), and erase, save and restore them; the
    # adapters' scales are the server's, for every tenant; its router mode loads and unloads models.
    "/slots",
    "/slots/*",
    "/lora-adapters",
    "/models/load",
    "/models/unload",
    # Its router mode also removes a cached model (DELETE /models) and downloads one (POST /models);
    # GET /models is the model list. With --ui-mcp-proxy it fetches any URL (/cors-proxy), with
    # --tools it runs the server's tools (/tools), and with --props it takes new settings (POST /props).
    "DELETE /models",
    "POST /models",
    "/cors-proxy",
    "/tools",
    "POST /props",
    # Ollama's model management (the engine inside is llama.cpp's), and its ollama.com account: signing
    # the server out (cloud models gone for everyone), the account's name, searches it pays for.
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/delete",
    "/api/blobs/*",
    "/api/signout",
    "/api/user/*",
    "/api/me",
    "/api/experimental/*",
]


UNGOVERNED_GENERATION_ROUTES = [
    "/invocations",
    "/v1/chat/completions/batch",
    "/cohere/v2/chat",
    "/inference/v1/generate",
    "/generative_scoring",
    # llama-server's routes outside /v1 (the same handlers as /v1/chat/completions and
    # /v1/completions, its native completion and infill) and Ollama's native API, which
    # llama-server also answers at /api/chat.
    "/completion",
    "/completions",
    "/chat/completions",
    "/infill",
    "/responses",
    "/api/chat",
    "/api/generate",
    # Speech to text decodes tokens too (Whisper), outside the budget; llama-server answers it at
    # the root too. Ollama's image routes run its generate handler.
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/audio/transcriptions",
    "/v1/images/generations",
    "/v1/images/edits",
]


# Routes of the engines that neither generate nor change the engine: what a tenant may reach through
# the pass-through while tenants or budgets govern generation (a route not listed may generate, or
# be an operator's: no list of the dangerous ones keeps up with the engines).
TENANT_ROUTES = [
    # vLLM 0.32: token counts, pooling models, the prompt a template renders, the server's state.
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/pooling",
    "/classify",
    "/v2/embed",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/v1/messages/count_tokens",
    "/v1/models/*",
    "GET /version",
    "GET /health",
    "GET /load",
    "GET /ping",
    # llama-server: its health, settings and model list, embeddings, reranking and templating.
    "GET /v1/health",
    "GET /props",
    "GET /models",
    "/embedding",
    "/embeddings",
    "/reranking",
    "/v1/reranking",
    "/apply-template",
    # Ollama: its version, models, loaded models and embeddings.
    "GET /",
    "HEAD /",
    "/api/version",
    "/api/tags",
    "/api/ps",
    "/api/show",
    "/api/embed",
    "/api/embeddings",
]


# The methods a route pattern may name (``DELETE /models``).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _route_patterns(patterns: list[str] | None) -> list[str] | None:
    """Each a path from ``/`` (``*`` matching any run of characters), or a method, one space and a
    path: anything else would match no request, silently."""
    for pattern in patterns or ():
        verb, space, route = pattern.partition(" ")
        path = route if space and verb.upper() in HTTP_METHODS else pattern
        if not path.startswith(("/", "*")) or any(character.isspace() for character in path):
            raise ValueError(
                f"{pattern!r} is not a route pattern: write a path from / ('*' matches any run of characters), "
                "or a method, a space and a path (DELETE /models)"
            )
    return patterns


class RouteSettings(Section):
    """Routes of the backend the proxy has no handler of its own for (docs/protocols.md).

    Patterns are paths, ``*`` matching any run of characters (``/fault_tolerance/*``), each for
    every method, or for one where a method comes first (``DELETE /models``).
    """

    # Forward the backend's other routes (tokenize, rerank, score, pooling, audio, routes added
    # later) as they are, with tenant auth, metrics and routing by model; false: 404.
    passthrough: bool = True
    # Reachable only with the admin key (Authorization: Bearer <admin_api_key>), sent upstream with
    # the proxy's own upstream key; 403 when no admin key is configured.
    admin_routes: list[str] = Field(default_factory=lambda: list(DEFAULT_ADMIN_ROUTES))
    # Never forwarded (404), whoever asks.
    denied_routes: list[str] = Field(default_factory=list)
    # When set, only these (and the admin routes, for the admin) are forwarded; others 404.
    allowed_routes: list[str] | None = None
    # vLLM routes that generate text outside the proxy's pipeline (no budget, no tenant cache
    # salt: /invocations takes a chat body). With tenants or usage budgets configured they are a
    # way around both, so they answer 404 unless listed in allowed_routes.
    ungoverned_generation: list[str] = Field(default_factory=lambda: list(UNGOVERNED_GENERATION_ROUTES))
    # While tenants or budgets govern generation and allowed_routes is unset, the only routes a
    # tenant reaches through the pass-through (others 404): those known not to generate nor change
    # the engine. allowed_routes, when set, replaces them.
    tenant_routes: list[str] = Field(default_factory=lambda: list(TENANT_ROUTES))

    _patterns = field_validator(
        "admin_routes", "denied_routes", "allowed_routes", "ungoverned_generation", "tenant_routes"
    )(_route_patterns)


class ResponsesSettings(Section):
    """``/v1/responses``: where stored responses live (vLLM keeps them in its process)."""

    # How long the proxy remembers which backend holds a stored response (and its chain).
    chain_ttl_s: int = Field(7 * 24 * 3600, gt=0)


class TracingSettings(Section):
    """OpenTelemetry traces (docs/metrics.md, "Traces (OpenTelemetry)"): a span per request, its
    context sent upstream as ``traceparent``. Needs the extra: ``pip install 'prefix-proxy[otel]'``."""

    enabled: bool = False
    # otlp-http (a collector's port 4318), otlp-grpc (4317) or console (stdout, for a look).
    exporter: Literal["otlp-http", "otlp-grpc", "console"] = "otlp-http"
    # The collector: http://collector:4318 (OTLP/HTTP; /v1/traces is added to a URL without a
    # path) or http://collector:4317 (gRPC). Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT, as the SDK reads them, else localhost.
    endpoint: str | None = None
    service_name: str = "prefix-proxy"
    # The share of traces recorded (by trace id); a client's traceparent decides for its trace.
    sample_ratio: float = Field(1.0, ge=0, le=1)

    @model_validator(mode="after")
    def _collector(self) -> TracingSettings:
        """The collector's URL as the exporter takes it: http(s) with a host and a port a server can
        listen on (gRPC's exporter also takes HOST:PORT)."""
        if not self.enabled or self.endpoint is None or self.exporter == "console":
            return self
        text = self.endpoint.strip()
        grpc = self.exporter == "otlp-grpc"
        example = "http://collector:4317" if grpc else "http://collector:4318"
        try:
            parts = urlsplit(text if "://" in text or not grpc else f"http://{text}")
            port = parts.port
        except ValueError:
            why = f"not a collector URL (a bracket or the port): write e.g. {example}"
            raise conflict(("endpoint",), why) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise conflict(("endpoint",), f"a collector is an http(s) URL with a host: write e.g. {example}")
        if port is not None and not 1 <= port <= 65535:
            raise conflict(("endpoint",), "the port of the collector's URL must be a number from 1 to 65535")
        return self

    @model_validator(mode="after")
    def _installed(self) -> TracingSettings:
        """What start-up imports (proxy.observability.tracing), imported now."""
        if not self.enabled:
            return self
        if not _importable("opentelemetry.sdk.trace"):
            raise conflict(
                ("enabled",), f"OpenTelemetry is not installed: {OTEL_INSTALL_HINT}, or set tracing.enabled false"
            )
        if not _importable(OTEL_EXPORTER_MODULES[self.exporter]):
            raise conflict(("exporter",), f"the {self.exporter} exporter is not installed: {OTEL_INSTALL_HINT}")
        return self


class UiSettings(Section):
    """The operator's page, ``GET /ui`` (docs/metrics.md, "The operator's page"): per app, hit rate and
    prefill against its floor, the system prompt's varying and moved units, the last cache breaks,
    sessions and budgets. Off by default; needs ``admin_api_key`` (HTTP Basic, any user name, the admin
    key as password; or ``Authorization: Bearer``). With ``metrics_port`` set it is served there, beside
    ``/metrics``, and the API port answers 404. Prompt text appears only where ``log_prompts`` or
    ``capture`` already keeps it; otherwise digests, line counts, unit kinds and positions."""

    enabled: bool = False
    # Apps remembered (tenant, model, template), least recently seen out.
    max_apps: int = Field(64, gt=0)
    # Line hashes each app remembers for its floor (about 50 bytes each); a forgotten line counts again.
    floor_lines: int = Field(8192, gt=0)
    # Last cache breaks kept, across apps (and per app, up to this many).
    breaks: int = Field(50, gt=0)
    # Sessions listed per tenant (read from the session store when the page is asked for).
    sessions: int = Field(20, ge=0)
    # The longest system prompt text kept per app (only where prompt text may be shown).
    prompt_chars: int = Field(32_768, gt=0)


class ReadinessSettings(Section):
    """What ``/readyz`` needs besides a backend that serves the API (docs/deploy.md, "Readiness")."""

    # false: a replica whose session store (Redis) is down stays ready (200, "degraded" in the body,
    # prefix_proxy_readiness{state="degraded"}): it serves without sessions meanwhile, and a store
    # outage does not take every replica out of the load balancer at once. true: 503 until the store
    # answers, for a fleet that would rather refuse traffic than serve it without sessions and budgets.
    require_store: bool = False


class EngineSettings(Section):
    """What the proxy cannot read from an engine (docs/engines.md)."""

    # The context an Ollama model gets when its Modelfile sets no num_ctx (Ollama's OpenAI API does not
    # say it): Ollama's own default. Past it Ollama drops the start of the prompt instead of refusing it,
    # so the proxy compacts before it. Set it to the OLLAMA_CONTEXT_LENGTH the server runs with.
    ollama_num_ctx: int = Field(4096, gt=0)


class Settings(BaseSettings):
    """Everything the proxy reads at start-up."""

    # An error names the setting, never echoes its input: settings hold keys and credentialed URLs.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        hide_input_in_errors=True,
        allow_inf_nan=False,
    )
    _within_reach = field_validator("*")(_within_reach)

    upstream: str = "http://127.0.0.1:8000/v1"
    # Several backends (base URLs) instead of ``upstream``: a list, or a comma-separated string.
    upstreams: Annotated[list[str], NoDecode] = Field(default_factory=list)
    upstream_api_key: HeaderKey | None = None
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    host: ListenHost = "127.0.0.1"
    port: Port = 8080
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    # Per read: the longest the upstream may stay silent (a long prefill included).
    upstream_timeout_s: float = Field(600.0, gt=0)
    # Overall deadline of one request, from its arrival to the last byte of the answer (a stream
    # included): past it the client gets 504, or an error event once a stream has started. Per-read
    # timeouts alone let an upstream that drips a byte at a time hold a request forever.
    request_timeout_s: float = Field(3600.0, gt=0)
    # Deadlines on the way in (proxy/http/inbound.py), from a request's start (its connection opening,
    # or on a kept-alive connection its first byte), both capped by request_timeout_s: the request line
    # and headers within request_header_timeout_s, else the connection is closed; the whole request,
    # body included, within request_body_timeout_s (a trickle does not extend it), else 408 (or a
    # close once the answer has started). 60 s lets a max_body_bytes body in at ~4.5 Mbit/s.
    request_header_timeout_s: float = Field(10.0, gt=0)
    request_body_timeout_s: float = Field(60.0, gt=0)
    # Connections whose request has not finished arriving (a new one counts from its opening); one
    # more and the oldest of them is closed, so slow clients cannot hold every socket nor lock out a
    # request that arrives at once.
    max_incomplete_requests: int = Field(512, gt=0)
    # The largest single SSE event accepted from the upstream (vLLM's are a token or a tool call's
    # arguments); a larger one ends the stream with an error event instead of growing the buffer.
    max_sse_event_bytes: int = Field(8 * 1024 * 1024, gt=0)
    max_connections: int = Field(1000, gt=0)
    # How long an idle connection to a backend is kept for reuse. Below the backend's own keep-alive
    # timeout (uvicorn's, and so vLLM's, is 5 s): otherwise a request can be written on a connection
    # the backend is closing at that moment, a 502 the proxy cannot retry (the request may have
    # been read).
    upstream_keepalive_s: float = Field(4.0, ge=0)
    # No effect, either value: every upstream request goes through the one upstream transport
    # (proxy/backends/transport.py: aiohttp's pool behind httpx's transport API), which measured
    # less CPU per request than httpx's own. Still accepted so existing configs load; check-config
    # notes it when it is set.
    upstream_transport: Literal["aiohttp", "httpx"] = "aiohttp"
    log_level: Annotated[LogLevel, BeforeValidator(_lower)] = "info"
    log_prompts: bool = False
    metrics_max_label_values: int = Field(64, gt=0)
    # /metrics names tenants and backends and counts every tenant's traffic: keep it from clients
    # with a bearer token of its own (Prometheus: authorization.credentials), a listen address of
    # its own (metrics_port; then the API port answers /metrics with 404), or both.
    metrics_api_key: HeaderKey | None = None
    metrics_host: ListenHost | None = None  # default: ``host``
    metrics_port: Port | None = None
    canon: CanonSettings = Field(default_factory=CanonSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    summarizer: SummarizerSettings = Field(default_factory=SummarizerSettings)
    routes: RouteSettings = Field(default_factory=RouteSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    model_budgets: dict[str, BudgetOverrides] = Field(default_factory=dict)
    tenants: list[TenantSettings] = Field(default_factory=list)
    # With tenants configured, each gets its own vLLM cache_salt: no tenant's requests hit blocks
    # another cached (no timing channel between tenants; also no sharing of a common prompt).
    tenant_cache_isolation: bool = True
    # The key of those salts (a keyed hash of the tenant's name: no tenant can compute another's).
    # Unset: generated once and kept in the Redis session store, so replicas agree (in-memory
    # store: one per process, the cache cold after every restart). Changing it cold-starts the
    # prefix cache once (docs/sessions.md).
    cache_salt_secret: SecretStr | None = None
    admin_api_key: HeaderKey | None = None
    max_model_len_cache_s: float = Field(300.0, ge=0)
    # The served model's KV shape, for the session KV-bytes gauge: a preset name or a config.json path.
    kv_model: str | None = None
    kv_config_json: str | None = None
    kv_dtype: str = "fp16"
    sessions_active_window_s: float = Field(900.0, gt=0)
    cache_breaks: CacheBreakSettings = Field(default_factory=CacheBreakSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    readiness: ReadinessSettings = Field(default_factory=ReadinessSettings)
    ui: UiSettings = Field(default_factory=UiSettings)
    engines: EngineSettings = Field(default_factory=EngineSettings)

    # The config file's settings, read once by load_settings() and set on a subclass; otherwise the
    # file the PREFIX_PROXY_CONFIG environment variable names is read here.
    file_data: ClassVar[dict[str, Any] | None] = None
    # Settings a flag replaced, not read from the environment or the file (set on a subclass):
    # ``--upstream`` stands for both upstream and upstreams.
    replaced_by_flags: ClassVar[frozenset[str]] = frozenset()

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return _upstream_url(value)

    @field_validator("upstreams", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        value = _string_list(value)
        return [_upstream_url(u) for u in value] if isinstance(value, list) else value

    @field_validator("upstreams")
    @classmethod
    def _distinct_upstreams(cls, urls: list[str]) -> list[str]:
        """Each backend once: two URLs of one server (host, port and path) would be one backend under
        one name twice (its metrics, its health, its share of the routing)."""
        names: dict[str, int] = {}
        for index, url in enumerate(urls):
            earlier = names.setdefault(backend_name(url), index)
            if earlier != index:
                raise conflict(
                    (index,),
                    f"the backend {backend_name(url)} twice (upstreams[{earlier}] and upstreams[{index}] name the "
                    "same host, port and path): list each backend once",
                )
        return urls

    @field_validator("tenants")
    @classmethod
    def _distinct_tenants(cls, tenants: list[TenantSettings]) -> list[TenantSettings]:
        """Two tenants with one key: the last would take every request of both. Two with one name:
        one budget, one metrics label, one cache salt."""
        names: dict[str, int] = {}
        keys: dict[str, int] = {}
        for index, tenant in enumerate(tenants):
            earlier = keys.setdefault(tenant.api_key.get_secret_value(), index)
            if earlier != index:
                raise conflict(
                    (index, "api_key"),
                    f"the same key as tenants[{earlier}] ({tenants[earlier].name!r}): one of them would never "
                    "be recognized; give each tenant a key of its own",
                )
            earlier = names.setdefault(tenant.name, index)
            if earlier != index:
                raise conflict(
                    (index, "name"),
                    f"the same name as tenants[{earlier}]: budgets, metrics and cache salts are per name; "
                    "give each tenant a name of its own",
                )
        return tenants

    @property
    def upstream_urls(self) -> list[str]:
        """The backends to forward to: ``upstreams`` when set, else the one ``upstream``."""
        return self.upstreams or [self.upstream]

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Settings that contradict each other, or one that another makes do nothing."""
        if "upstream" in self.model_fields_set and self.upstreams:
            raise conflict(
                ("upstream",),
                "set beside upstreams, which would replace it: list every backend in upstreams and remove "
                "upstream (or give one backend in upstream alone)",
            )
        if self.metrics_port is not None and self.metrics_port == self.port:
            metrics_host = self.metrics_host or self.host
            if (
                metrics_host == self.host
                or WILDCARD_HOSTS & {metrics_host, self.host}
                or _addresses_of(metrics_host) & _addresses_of(self.host)
            ):
                raise conflict(
                    ("metrics_port",),
                    f"the same port as port ({self.port}): /metrics needs a port of its own; choose another, "
                    "or remove metrics_port to serve /metrics on the API's port",
                )
        tenant_keys = {t.api_key.get_secret_value(): t.name for t in self.tenants}
        for name in ("admin_api_key", "metrics_api_key"):
            secret: SecretStr | None = getattr(self, name)
            if secret is not None and secret.get_secret_value() in tenant_keys:
                raise conflict(
                    (name,),
                    f"the same key as tenant {tenant_keys[secret.get_secret_value()]!r}: that tenant would hold "
                    "it too; give it a key of its own",
                )
        if self.ui.enabled and (self.admin_api_key is None or not self.admin_api_key.get_secret_value()):
            raise conflict(
                ("ui", "enabled"),
                "needs admin_api_key: the page shows every tenant's apps and sessions; set admin_api_key",
            )
        if self.sessions.store != "redis":
            if self.replicas.share_memories:
                raise conflict(
                    ("replicas", "share_memories"), "needs the Redis session store: set sessions.store: redis"
                )
            if self.sessions.tenants_in_redis:
                raise conflict(
                    ("sessions", "tenants_in_redis"), "needs the Redis session store: set sessions.store: redis"
                )
        legacy = self.sessions.ready_when_store_down
        if legacy is not None:
            if "require_store" in self.readiness.model_fields_set and self.readiness.require_store == legacy:
                raise conflict(
                    ("sessions", "ready_when_store_down"),
                    "contradicts readiness.require_store, which replaces it: remove sessions.ready_when_store_down",
                )
            self.readiness.require_store = not legacy
        return self

    @model_validator(mode="after")
    def _check_upstream_urls(self) -> Settings:
        """An upstream URL is a base the API's paths are appended to: a query string or fragment
        would swallow them. Credentials in it (``user:password@``, sent as Basic auth) would replace
        any upstream key on every request: one or the other."""
        keyed = "upstream_api_key" if self.upstream_api_key else None
        tenant = next((t.name for t in self.tenants if t.upstream_api_key), None)
        keyed = keyed or (f"tenants[{tenant!r}].upstream_api_key" if tenant is not None else None)
        for index, url in enumerate(self.upstream_urls):
            loc: tuple[str | int, ...] = ("upstreams", index) if self.upstreams else ("upstream",)
            parts = urlsplit(url)
            shown = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path}"
            if "?" in url or "#" in url:
                raise conflict(
                    loc,
                    f"upstream URL {shown} has a query string or fragment, which every forwarded path would "
                    "land in: give the base URL alone (requests keep their own query strings)",
                )
            if keyed and (parts.username or parts.password):
                raise conflict(
                    loc,
                    f"upstream URL {shown} carries credentials (user:password@) and {keyed} is set: the "
                    f"URL's would replace the key on every request; remove one of them",
                )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        data = cls.file_data
        if data is None and os.environ.get(CONFIG_FILE_ENV):
            data = read_config_file(Path(os.environ[CONFIG_FILE_ENV]))
        if data is not None:
            sources.append(InitSettingsSource(settings_cls, data))
        if isinstance(env_settings, EnvSettingsSource):
            # Neither a setting a flag replaced nor a Kubernetes service link is read as a setting.
            ignored = {f"{ENV_PREFIX}{name}".lower() for name in cls.replaced_by_flags}
            present = {k: v for k, v in env_settings.env_vars.items() if v is not None}
            ignored |= {name.lower() for name in service_links(present)}
            if ignored:
                env_settings.env_vars = {k: v for k, v in env_settings.env_vars.items() if k.lower() not in ignored}
        return tuple(sources)


def _upstream_url(value: str) -> str:
    """A backend's base URL, checked: http(s), a host, a port a server can listen on; the trailing
    slash dropped."""
    text = value.strip().rstrip("/")
    try:
        parts = urlsplit(text)
    except ValueError:  # an unclosed [ (an IPv6 address)
        raise ValueError("not a URL: write an IPv6 host in brackets, http://[::1]:8000/v1") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        hint = f"http://{text}" if "://" not in text else "http://HOST:PORT/v1"
        raise ValueError(f"an upstream is an http(s) base URL such as http://127.0.0.1:8000/v1: write {hint}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("the port of an upstream URL must be a number from 1 to 65535")
    host = parts.hostname
    if not _UPSTREAM_HOST.fullmatch(host) or host.endswith("."):
        raise ValueError(
            f"{host!r} is not a host name or address (letters, digits, '-' and '.', no space or trailing dot): "
            "write the backend's host as its server answers to it"
        )
    if any(c.isspace() for c in parts.path) or _BAD_ESCAPE.search(parts.path):
        raise ValueError(
            "the path of an upstream URL has a space or a % not followed by two hex digits: "
            "write the API's path as the server serves it, e.g. /v1"
        )
    return text


# A host an HTTP client can connect to: a DNS name (letters of any script, digits, '-', '_' and dots), an IPv4 address,
# or an IPv6 address (urlsplit gives it without its brackets).
_UPSTREAM_HOST = re.compile(r"[\w.-]+|[0-9A-Fa-f:.]+(%[A-Za-z0-9]+)?")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def backend_name(base_url: str) -> str:
    """``host:port`` (and a path other than ``/v1``): what metrics and logs call a backend.

    Never the URL itself, which may carry credentials.
    """
    parts = urlsplit(base_url)
    host = parts.hostname or "upstream"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path.rstrip("/")
    return f"{host}:{port}" + (path if path and path != "/v1" else "")


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Build settings; ``overrides`` are CLI flags (highest precedence, None means unset).

    Raises :class:`ConfigError`: every problem, one line each, naming its file key, flag or
    environment variable. (``serve`` and ``check-config`` load through :mod:`proxy.preflight`,
    which adds the checks of values another part of the proxy defines.)"""
    return load_with_sources(config_file, **overrides)[0]


def check_settings(config_file: str | None = None, **overrides: Any) -> tuple[list[str], list[str], list[str]]:
    """``prefix-proxy check-config``: the effective settings as ``key = value  [source]`` lines
    (secrets masked), the problems (none when the settings load), and notes on settings that load
    but do nothing."""
    try:
        settings, sources = load_with_sources(config_file, **overrides)
    except ConfigError as error:
        return [], error.problems, []
    return effective(settings, sources), [], notes(sources)


# Settings still accepted, so that configs written for an earlier release load, that no longer do
# anything (or that another setting replaced): why, for check-config to say when one is set.
NO_EFFECT: dict[tuple[str, ...], str] = {
    ("upstream_transport",): (
        "has no effect: every upstream request goes through the one upstream transport "
        "(aiohttp's connection pool behind httpx's transport API); remove it"
    ),
    ("sessions", "ready_when_store_down"): (
        "replaced by readiness.require_store, its opposite (whose default, false, keeps a replica whose "
        "store is down ready): write readiness.require_store instead"
    ),
}
# The settings one flag stands for: ``--upstream`` gives the backends, once or repeated.
BACKEND_FLAGS = frozenset({"upstream", "upstreams"})


def notes(sources: Sources) -> list[str]:
    """What check-config notes about settings that load: each set one of :data:`NO_EFFECT`, and
    backends that ``--upstream`` replaced."""
    found = [f"{sources.where(loc)}: {why}" for loc, why in NO_EFFECT.items() if sources.origin(loc) != "default"]
    if sources.links:
        found.append(
            f"{', '.join(sorted(sources.links))}: not read: Kubernetes sets these for a Service in the pod's namespace "
            "(service links; set enableServiceLinks: false in the pod spec to leave them out)"
        )
    if sources.flags.keys() & BACKEND_FLAGS:
        for name in sorted(BACKEND_FLAGS - sources.flags.keys()):
            origin = sources.origin((name,))
            if origin != "default":
                found.append(f"{origin}: replaced by --upstream")
    return found


def load_with_sources(config_file: str | None = None, **overrides: Any) -> tuple[Settings, Sources]:
    """:func:`load_settings`, and what they were built from (to name a setting's source)."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    config_file = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    sources = Sources.gather(Path(config_file) if config_file else None, flags, os.environ, ENV_PREFIX)
    problems = sources.unknown_variables(Settings, {CONFIG_FILE_ENV})
    # --upstream replaces the backends the environment or the file gives, under either name.
    replaced = BACKEND_FLAGS - flags.keys() if flags.keys() & BACKEND_FLAGS else frozenset()
    attributes: dict[str, Any] = {}
    if config_file:
        # The file as read for the sources (once), on a subclass: no global state.
        attributes["file_data"] = {k: v for k, v in sources.file_data.items() if k not in replaced}
    if replaced:
        attributes["replaced_by_flags"] = replaced
    settings_class = type("Settings", (Settings,), attributes) if attributes else Settings
    try:
        settings = settings_class(**flags)
    except ValidationError as error:
        raise ConfigError(problems + explain(error, Settings, sources)) from None
    except SettingsError as error:
        # A variable the settings could not decode (JSON expected), before any value was checked.
        raise ConfigError(problems + explain_settings_error(error, Settings, sources)) from None
    if problems:
        raise ConfigError(problems)
    return settings, sources
