"""Configuration: CLI flags > environment (PREFIX_PROXY_*) > config file (YAML/TOML) > defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
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
    learned_apps_max: int = 1024
    learned_history: int = 8
    rules: list[VolatileRule] = Field(default_factory=list)
    builtin_detectors: list[str] = Field(
        default_factory=lambda: ["context_block", "datetime", "weekday", "uuid", "request_id"]
    )
    # Per-model overrides of the mode, e.g. {"my-model": "safe"}.
    model_modes: dict[str, CanonMode] = Field(default_factory=dict)


class Settings(BaseSettings):
    """Everything the proxy reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="PREFIX_PROXY_", env_nested_delimiter="__", extra="ignore")

    upstream: str = "http://127.0.0.1:8000/v1"
    upstream_api_key: SecretStr | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    max_connections: int = 1000
    log_level: str = "info"
    log_prompts: bool = False
    metrics_max_label_values: int = 64
    canon: CanonSettings = Field(default_factory=CanonSettings)

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

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
        config_file = os.environ.get(CONFIG_FILE_ENV)
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
    if config_file:
        os.environ[CONFIG_FILE_ENV] = config_file
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
