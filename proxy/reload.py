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

from proxy.app_state import ProxyState
from proxy.config import Settings
from proxy.config_sources import ConfigError

# What a reload applies; everything else needs a restart.
LIVE_SETTINGS = ("tenants", "canon", "budget", "model_budgets", "log_level", "readiness")

logger = logging.getLogger("prefix_proxy.reload")


def reload_settings(state: ProxyState, load: Callable[[], Settings]) -> list[str]:
    """Apply what ``load()`` gives that can change live; returns the settings applied."""
    try:
        new = load()
    except ConfigError as error:
        for problem in error.problems:
            logger.error("reload refused, the configuration is unchanged: %s", problem)
        return []
    old = state.settings
    changed = [name for name in type(old).model_fields if getattr(old, name) != getattr(new, name)]
    applied = [name for name in changed if name in LIVE_SETTINGS]
    needs_restart = [name for name in changed if name not in LIVE_SETTINGS]
    if "tenants" in applied:
        state.tenants.replace(new.tenants)
    if "canon" in applied:
        state.canonicalizer.configure(new.canon)
    if "log_level" in applied:
        logging.getLogger("prefix_proxy").setLevel(new.log_level.upper())
    state.settings = old.model_copy(update={name: getattr(new, name) for name in applied})
    logger.info(
        "reloaded",
        extra={"fields": {"event": "reloaded", "applied": applied, "needs_restart": needs_restart}},
    )
    return applied


def on_sighup(state: ProxyState, load: Callable[[], Settings]) -> Callable[[], object] | None:
    """Reload on SIGHUP from now on (in the main thread's event loop); returns the undo, or None
    where signals cannot be handled here (another thread, no SIGHUP on this platform)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload_settings, state, load)
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
