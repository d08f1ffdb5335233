"""SIGHUP: read the configuration again and apply what can change while serving.

Tenants (keys, upstream keys, budgets), canonicalization (modes, rules, detectors, placement),
budgets, the log level and what readiness requires change in place: requests in flight finish as they started, the next
ones see the new settings, and no connection is dropped. A changed setting that needs a new
process (listen address, upstreams, the store...) is kept as it is and named in the log line. A
configuration with problems changes nothing: each problem is logged, one line each. The process
never terminates on SIGHUP.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from proxy.app_state import ProxyState
from proxy.config import Settings
from proxy.config_sources import ConfigError

# What a reload applies; everything else needs a restart.
LIVE_SETTINGS = ("tenants", "canon", "budget", "model_budgets", "log_level", "readiness")
# Keys of a live section that size or switch what is built once, at start (the canonicalizer's
# memories, the rewrite shadow): a change to one of them needs a restart, the rest applies.
RESTART_KEYS: dict[str, frozenset[str]] = {
    "canon": frozenset(
        {
            "move_only_varying",
            "remember_layouts",
            "layout_memory_entries",
            "learn_volatility",
            "learned_apps_max",
            "learned_history",
            "text_memory_lines",
            "shadow",
        }
    ),
}

logger = logging.getLogger("prefix_proxy.reload")


def reload_settings(state: ProxyState, load: Callable[[], Settings]) -> list[str]:
    """Apply what ``load()`` gives that can change live; returns the settings applied."""
    try:
        new = load()
    except ConfigError as error:
        for problem in error.problems:
            logger.error("reload refused, the configuration is unchanged: %s", problem)
        return []
    except Exception as error:  # never terminates, never a traceback: one line
        logger.error("reload refused, the configuration is unchanged: %s: %s", type(error).__name__, error)
        return []
    old = state.settings
    changed = [name for name in type(old).model_fields if getattr(old, name) != getattr(new, name)]
    needs_restart = [name for name in changed if name not in LIVE_SETTINGS]
    updates = {}
    for name in (name for name in changed if name in LIVE_SETTINGS):
        value, held = _live_part(name, getattr(old, name), getattr(new, name))
        needs_restart += held
        if value != getattr(old, name):
            updates[name] = value
    applied = list(updates)
    if "tenants" in updates:
        state.tenants.replace(updates["tenants"])
    if "canon" in updates:
        state.canonicalizer.configure(updates["canon"])
    if "log_level" in updates:
        logging.getLogger("prefix_proxy").setLevel(updates["log_level"].upper())
    state.settings = old.model_copy(update=updates)
    logger.info(
        "reloaded",
        extra={"fields": {"event": "reloaded", "applied": applied, "needs_restart": needs_restart}},
    )
    return applied


def _live_part(name: str, old: Any, new: Any) -> tuple[Any, list[str]]:
    """What of section ``name``'s new value applies live (its restart keys kept as they are), and
    the restart keys that changed, named ``section.key``."""
    keys = RESTART_KEYS.get(name)
    if not keys:
        return new, []
    held = sorted(key for key in keys if getattr(old, key) != getattr(new, key))
    if not held:
        return new, []
    return new.model_copy(update={key: getattr(old, key) for key in held}), [f"{name}.{key}" for key in held]


def on_sighup(state: ProxyState, load: Callable[[], Settings]) -> Callable[[], object] | None:
    """Reload on SIGHUP from now on (in the main thread's event loop); returns the undo, or None
    where signals cannot be handled here (another thread, no SIGHUP on this platform)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload_settings, state, load)
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
