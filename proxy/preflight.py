"""The settings ``serve`` and ``check-config`` load: :mod:`proxy.config`'s, and the checks of values
whose meaning another part of the proxy defines, which the settings' schema (a leaf) cannot import.

``kv_model`` is one of :mod:`proxy.capacity`'s presets, ``kv_config_json`` a model's config.json it
reads, ``kv_dtype`` a dtype it knows: checked here as the settings load, so ``check-config`` finds
what start-up would trip on, and both say it in one line naming the setting.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from proxy.backends import tls_problem
from proxy.capacity import DTYPE_BYTES, PRESETS, shape_from_hf_config
from proxy.config import Settings, load_with_sources, notes
from proxy.config_sources import ConfigError, Sources, effective, problem_line
from proxy.sessions import client_problem


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """:func:`proxy.config.load_settings` and the checks below; :class:`ConfigError` on any problem."""
    settings, sources = load_with_sources(config_file, **overrides)
    found = problems(settings, sources)
    if found:
        raise ConfigError(found)
    return settings


def check_settings(config_file: str | None = None, **overrides: Any) -> tuple[list[str], list[str], list[str]]:
    """``check-config``'s answer, as :func:`proxy.config.check_settings` gives it, the checks below
    included: the effective settings with their sources, the problems, the notes."""
    try:
        settings, sources = load_with_sources(config_file, **overrides)
    except ConfigError as error:
        return [], error.problems, []
    found = problems(settings, sources)
    if found:
        return [], found, []
    return effective(settings, sources), [], notes(sources)


def problems(settings: Settings, sources: Sources) -> list[str]:
    """One line per value of ``settings`` that another part of the proxy would refuse at start-up."""
    found = []
    if settings.kv_model is not None and settings.kv_model.lower() not in PRESETS:
        match = difflib.get_close_matches(settings.kv_model.lower(), PRESETS, n=1)
        hint = f"did you mean {match[0]!r}? " if match else ""
        message = f"not a model preset: {hint}presets: {', '.join(PRESETS)}; or kv_config_json, a model's config.json"
        found.append(problem_line(sources, ("kv_model",), message, settings.kv_model))
    if settings.kv_config_json is not None:
        why = _config_json_problem(Path(settings.kv_config_json))
        if why:
            found.append(problem_line(sources, ("kv_config_json",), why, settings.kv_config_json))
    if settings.kv_dtype.lower() not in DTYPE_BYTES:
        message = f"not a KV cache dtype: one of {', '.join(DTYPE_BYTES)}"
        found.append(problem_line(sources, ("kv_dtype",), message, settings.kv_dtype))
    sessions = settings.sessions
    if sessions.store == "redis" or settings.replicas.share_memories:
        why = client_problem(sessions)
        if why:
            message = f"redis-py refuses it: {why}; fix the URL (or redis_cluster / redis_sentinels)"
            found.append(problem_line(sources, ("sessions", "redis_url"), message, sessions.redis_url))
    tls = tls_problem()
    if tls:
        found.append(tls)
    return found


def _config_json_problem(path: Path) -> str | None:
    """Why :func:`proxy.capacity.kvcache.resolve_shape` could not read ``path``; None when it can."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    except (ValueError, UnicodeDecodeError):
        return "not JSON: give a model's Hugging Face config.json"
    try:
        shape_from_hf_config(config)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return "not a model's config.json: it needs num_hidden_layers, num_attention_heads and hidden_size"
    return None
