"""Scenarios by name, and building a deterministic set of sessions from them.

A scenario is a name, a one-line description and a factory ``(index, rng) -> Session``.
Adding one is a module under ``testbed/workload/scenarios/`` that calls
:func:`register_scenario` and is imported by that package's ``__init__``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from testbed.workload.session import Session

SessionFactory = Callable[[int, random.Random], Session]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    make_session: SessionFactory
    #: part of the default set the demo and the benches run
    default: bool = True
    #: long scenarios cap their number of sessions (each session is already a big workload)
    max_sessions: int | None = None


_SCENARIOS: dict[str, Scenario] = {}


def register_scenario(scenario: Scenario) -> Scenario:
    if scenario.name in _SCENARIOS:
        raise ValueError(f"scenario {scenario.name!r} is already registered")
    _SCENARIOS[scenario.name] = scenario
    return scenario


def scenario_names(*, include_all: bool = False) -> list[str]:
    """Registered scenario names in registration order (default ones unless ``include_all``)."""
    _load_builtin()
    return [s.name for s in _SCENARIOS.values() if include_all or s.default]


def get_scenario(name: str) -> Scenario:
    _load_builtin()
    try:
        return _SCENARIOS[name]
    except KeyError:
        known = ", ".join(_SCENARIOS)
        raise KeyError(f"unknown scenario {name!r}; known: {known}") from None


def resolve_scenarios(names: Iterable[str] | str | None) -> list[Scenario]:
    """Scenario objects for names (a comma-separated string works too); None: the defaults."""
    if names is None:
        return [get_scenario(n) for n in scenario_names()]
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return [get_scenario(n) for n in names]


def session_rng(seed: int, scenario: str, index: int) -> random.Random:
    """The session's own random stream: a function of (seed, scenario, index) only."""
    return random.Random(f"prefix-proxy-workload:{seed}:{scenario}:{index}")


def build_sessions(scenarios: Iterable[str] | str | None, sessions_per_scenario: int, seed: int) -> list[Session]:
    """All sessions, interleaved round-robin across scenarios (s0 of each, then s1 of each...)."""
    if sessions_per_scenario < 1:
        raise ValueError("sessions_per_scenario must be at least 1")
    resolved: Sequence[Scenario] = resolve_scenarios(scenarios)
    sessions: list[Session] = []
    for index in range(sessions_per_scenario):
        for scenario in resolved:
            if scenario.max_sessions is not None and index >= scenario.max_sessions:
                continue
            sessions.append(scenario.make_session(index, session_rng(seed, scenario.name, index)))
    return sessions


def _load_builtin() -> None:
    # Imported for its side effect (registration); late, to avoid an import cycle.
    import testbed.workload.scenarios  # noqa: F401
