"""SIGHUP's reload (``proxy.reload``): what it says it applied is in force everywhere it is read,
what it cannot apply is named, and a configuration that fails to load changes nothing."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.app import create_app
from proxy.app_state import ProxyState
from proxy.config import Settings
from proxy.http import BudgetExceeded
from proxy.reload import reload_settings
from proxy.tenants import Tenant


def _state(settings: Settings) -> ProxyState:
    return create_app(settings).state.proxy


def test_canon_keys_built_at_start_are_named_not_claimed(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(Settings())
    shadow, layouts = state.shadow, state.canonicalizer.layouts
    new = Settings(canon={"mode": "safe", "remember_layouts": False, "shadow": {"enabled": False}})
    with caplog.at_level(logging.INFO, logger="prefix_proxy.reload"):
        applied = reload_settings(state, lambda: new)
    assert applied == ["canon"]
    assert state.settings.canon.mode == "safe"  # live: applied
    # Built once, at start: still as they were, and the settings say so.
    assert state.shadow is shadow and state.canonicalizer.layouts is layouts
    assert state.settings.canon.remember_layouts and state.settings.canon.shadow.enabled
    (record,) = [r for r in caplog.records if r.getMessage() == "reloaded"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["needs_restart"] == ["canon.remember_layouts", "canon.shadow"]


def test_only_restart_keys_changed_applies_nothing() -> None:
    state = _state(Settings())
    applied = reload_settings(state, lambda: Settings(canon={"learn_volatility": False}))
    assert applied == []
    assert state.settings.canon.learn_volatility


def test_a_reloaded_budget_holds_for_the_summarizers_admission() -> None:
    state = _state(Settings())
    assert reload_settings(state, lambda: Settings(budget={"session_tokens_per_window": 10})) == ["budget"]
    admission = state.compaction._admission  # the service's own
    with pytest.raises(BudgetExceeded):
        asyncio.run(admission.admit(Tenant("acme", None, None), "m", "s1", 10_000))


def test_a_load_that_raises_changes_nothing_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(Settings())
    before = state.settings

    def load() -> Settings:
        raise AttributeError("'int' object has no attribute 'lower'")

    with caplog.at_level(logging.ERROR, logger="prefix_proxy.reload"):
        assert reload_settings(state, load) == []
    assert state.settings is before
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and record.exc_info is None
