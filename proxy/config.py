"""Configuration: CLI flags > environment (PREFIX_PROXY_*) > config file (YAML/TOML) > defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

CONFIG_FILE_ENV = "PREFIX_PROXY_CONFIG"

CanonMode = Literal["off", "safe", "relocate"]
RelocateTarget = Literal["before_last_user", "system_end"]


class VolatileRule(BaseModel):
    """A user rule that marks spans of system prompts as volatile."""

    name: str
    pattern: str | None = None
    start_marker: str | None = None
    end_marker: str | None = None


class CanonSettings(BaseModel):
    mode: CanonMode = "relocate"
    relocate_target: RelocateTarget = "before_last_user"
    normalize_whitespace: bool = True
    normalize_unicode: bool = True
    learn_volatility: bool = True
    # A moved block that is only a template around the user's message (Dify's {{#sys.query#}}) is
    # re-created in front of earlier user messages, so each turn extends the previous one.
    restore_query_blocks: bool = True
    learned_apps_max: int = 1024
    learned_history: int = 8
    rules: list[VolatileRule] = Field(default_factory=list)
    builtin_detectors: list[str] = Field(
        default_factory=lambda: ["context_block", "datetime", "weekday", "uuid", "request_id"]
    )
    # Per-model overrides of the mode, e.g. {"my-model": "safe"}.
    model_modes: dict[str, CanonMode] = Field(default_factory=dict)


def _string_list(value: Any) -> Any:
    """A list from the environment: JSON (``["a", "b"]``) or comma-separated (``a,b``)."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else [u for u in text.split(",") if u.strip()]
    if isinstance(value, list):
        return [str(u).strip() for u in value]
    return value


class BudgetSettings(BaseModel):
    """Token budgets. Unset limits mean unlimited; see docs/sessions.md for the semantics."""

    # Context budget per request; default: the model's max_model_len minus the request's max_tokens.
    context_limit_tokens: int | None = None
    # Fraction of the context budget at which a session becomes due for compaction.
    soft_ratio: float = Field(0.75, gt=0, le=1)
    session_tokens_per_window: int | None = None
    tenant_tokens_per_window: int | None = None
    window_s: int = Field(3600, gt=0)
    # Completion tokens reserved for a request without max_tokens while it is in flight.
    completion_reserve_tokens: int = Field(512, ge=0)
    # Near a limit, ask the backend's POST /tokenize (vLLM) for the exact count instead of estimating.
    exact_counts_via_tokenize: bool = False


class BudgetOverrides(BaseModel):
    context_limit_tokens: int | None = None
    soft_ratio: float | None = None
    session_tokens_per_window: int | None = None
    tenant_tokens_per_window: int | None = None
    window_s: int | None = None
    completion_reserve_tokens: int | None = None
    exact_counts_via_tokenize: bool | None = None

    def apply_to(self, base: BudgetSettings) -> BudgetSettings:
        return base.model_copy(update=self.model_dump(exclude_none=True))


class TenantSettings(BaseModel):
    name: str
    api_key: SecretStr
    upstream_api_key: SecretStr | None = None
    budget: BudgetOverrides = Field(default_factory=BudgetOverrides)


class SessionSettings(BaseModel):
    store: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Sentinel ("host:port" each): the master named redis_sentinel_service is found through
    # them, and followed across failovers; redis_url then gives only db, credentials and TLS.
    redis_sentinels: Annotated[list[str], NoDecode] = Field(default_factory=list)
    redis_sentinel_service: str = "mymaster"
    # For sentinels that require a password of their own (requirepass on the sentinels).
    redis_sentinel_password: SecretStr | None = None
    key_prefix: str = "prefix-proxy:"
    ttl_s: int = Field(7 * 24 * 3600, gt=0)
    # Explicit session ids: this header, then the body's prompt_cache_key, then (if enabled) user.
    header: str = "x-session-id"
    use_prompt_cache_key: bool = True
    use_user: bool = False
    # How long a Redis failure keeps the proxy in pass-through before it tries Redis again.
    retry_after_failure_s: float = 1.0
    operation_timeout_s: float = 0.5
    # Look up API keys in Redis too (hash <prefix>tenant:<sha256(key)> with name, budget JSON).
    tenants_in_redis: bool = False

    _split_sentinels = field_validator("redis_sentinels", mode="before")(_string_list)


class SummarizerSettings(BaseModel):
    enabled: bool = True
    keep_last_turns: int = Field(4, ge=0)
    max_summary_tokens: int = Field(512, gt=0)
    # None: summarize with the conversation's own model (its cached prefix is on that model).
    model: str | None = None
    instruction: str | None = None
    timeout_s: float = Field(60.0, gt=0)
    lock_ttl_s: float = Field(120.0, gt=0)
    retry_backoff_s: float = Field(30.0, ge=0)
    # Restore messages a client's sliding window dropped, until they are folded into the summary.
    sliding_window_repair: bool = False
    repair_max_tokens: int = Field(4096, gt=0)


RoutingPolicyName = Literal["affinity", "least_in_flight", "round_robin"]


class RoutingSettings(BaseModel):
    """How requests are spread over several upstreams (``upstreams``); see docs/routing.md."""

    # affinity: a conversation (or, without a session, an app's stable prefix) sticks to one backend,
    # whose prefix cache holds it; least_in_flight / round_robin: even load, no cache locality.
    policy: RoutingPolicyName = "affinity"
    # Affinity yields to the next backend once its own carries this many times the average load.
    balance_factor: float = Field(2.0, ge=1.0)
    # Active checks (GET /models on every backend) re-admit ejected backends and learn their models;
    # 0 leaves only passive ejection on failures.
    health_check_interval_s: float = Field(5.0, ge=0)


class Settings(BaseSettings):
    """Everything the proxy reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="PREFIX_PROXY_", env_nested_delimiter="__", extra="ignore")

    upstream: str = "http://127.0.0.1:8000/v1"
    # Several backends (base URLs) instead of ``upstream``: a list, or a comma-separated string.
    upstreams: Annotated[list[str], NoDecode] = Field(default_factory=list)
    upstream_api_key: SecretStr | None = None
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    max_connections: int = 1000
    # aiohttp under the httpx client API (faster); "httpx" uses httpx's own transport.
    upstream_transport: Literal["aiohttp", "httpx"] = "aiohttp"
    log_level: str = "info"
    log_prompts: bool = False
    metrics_max_label_values: int = 64
    canon: CanonSettings = Field(default_factory=CanonSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    summarizer: SummarizerSettings = Field(default_factory=SummarizerSettings)
    model_budgets: dict[str, BudgetOverrides] = Field(default_factory=dict)
    tenants: list[TenantSettings] = Field(default_factory=list)
    # With tenants configured, each gets its own vLLM cache_salt: no tenant's requests hit blocks
    # another cached (no timing channel between tenants; also no sharing of a common prompt).
    tenant_cache_isolation: bool = True
    admin_api_key: SecretStr | None = None
    max_model_len_cache_s: float = 300.0
    # The served model's KV shape, for the session KV-bytes gauge: a preset name or a config.json path.
    kv_model: str | None = None
    kv_config_json: str | None = None
    kv_dtype: str = "fp16"
    sessions_active_window_s: float = 900.0

    # Set on a subclass by load_settings(); otherwise the PREFIX_PROXY_CONFIG environment variable.
    config_file: ClassVar[str | None] = None

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("upstreams", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        value = _string_list(value)
        return [u.rstrip("/") for u in value] if isinstance(value, list) else value

    @property
    def upstream_urls(self) -> list[str]:
        """The backends to forward to: ``upstreams`` when set, else the one ``upstream``."""
        return self.upstreams or [self.upstream]

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
        config_file = cls.config_file or os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            sources.append(_file_source(settings_cls, Path(config_file)))
        return tuple(sources)


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    if path.suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    raise ValueError(f"config file must be .yaml, .yml or .toml, not {path.suffix!r}")


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Build settings; ``overrides`` are CLI flags (highest precedence, None means unset)."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    if not config_file:
        return Settings(**flags)
    file_settings = type("FileSettings", (Settings,), {"config_file": config_file})
    return file_settings(**flags)
