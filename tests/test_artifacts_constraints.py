"""constraints.txt: the one list of versions CI and the image install. It pins, at an exact version that meets
every specifier on the way, each package ``pip install -e ".[test,otel]"`` pulls in (read from what is
installed here, markers evaluated as pip does), the environment the tests run in has those versions, and the
install steps (scripts/test.sh, the Dockerfile: tests/test_artifacts_image.py) read it."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PROJECT = "prefix-proxy"
# The extras CI installs (test, which names prefix-proxy[otel]) and the image (otel).
EXTRAS = ("test", "otel")


def pins() -> dict[str, str]:
    """constraints.txt's ``name==version`` lines, by canonical name."""
    found: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        assert match, f"constraints.txt: {line!r} is not name==version"
        name = canonicalize_name(match[1])
        assert name not in found, f"constraints.txt pins {name} twice"
        found[name] = match[2]
    return found


def applies(requirement: Requirement, extras: set[str], python: str | None = None) -> bool:
    if requirement.marker is None:
        return True
    base = {"python_full_version": python} if python else {}
    return any(requirement.marker.evaluate({**base, "extra": extra}) for extra in extras or {""})


def requirements_of(distribution: str, extras: set[str], python: str | None = None) -> Iterator[Requirement]:
    try:
        texts = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        texts = []  # needed only on another interpreter (``python``): not installed here
    for text in texts:
        requirement = Requirement(text)
        if applies(requirement, extras, python):
            yield requirement


# Python 3.11 releases the project installs on besides this one: Debian 12's python3 is 3.11.2, where
# redis-py needs async-timeout (below 3.11.3).
OTHER_PYTHONS = ("3.11.2",)


def closure(python: str | None = None) -> dict[str, list[Requirement]]:
    """Every package the project with EXTRAS needs, directly or not, with what asked for it (on
    ``python``, a Python version, where given: else this interpreter)."""
    wanted: dict[str, list[Requirement]] = {}
    pending = [(PROJECT, set(EXTRAS))]
    expanded: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras = pending.pop()
        if (canonicalize_name(name), frozenset(extras)) in expanded:
            continue
        expanded.add((canonicalize_name(name), frozenset(extras)))
        for requirement in requirements_of(name, extras, python):
            key = canonicalize_name(requirement.name)
            if key != PROJECT:
                wanted.setdefault(key, []).append(requirement)
            pending.append((requirement.name, set(requirement.extras)))
    return wanted


def test_constraints_are_exact_pins() -> None:
    found = pins()
    assert len(found) > 50
    assert PROJECT not in found, "the project itself is not constrained (CI installs it editable)"


def test_constraints_pin_every_package_the_install_needs_within_its_specifiers() -> None:
    pinned = pins()
    needed = closure()
    for python in OTHER_PYTHONS:
        for name, asked in closure(python).items():
            needed.setdefault(name, asked)
    assert {"fastapi", "opentelemetry-sdk", "pytest", "uvicorn", "uvloop"} <= set(needed)
    missing = sorted(set(needed) - set(pinned))
    assert not missing, f"constraints.txt lacks {missing}: regenerate it (its header says how)"
    outside = {
        name: (pinned[name], [str(r) for r in asked if not r.specifier.contains(pinned[name], prereleases=True)])
        for name, asked in needed.items()
    }
    outside = {name: value for name, value in outside.items() if value[1]}
    assert not outside, f"pins outside what is required: {outside}"
    # Nothing stale: beyond the closure only the installers (pip, and setuptools, which builds the wheel).
    assert set(pinned) - set(needed) == {"pip", "setuptools"}
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (setuptools,) = [Requirement(r) for r in build_requires if Requirement(r).name == "setuptools"]
    assert setuptools.specifier.contains(pinned["setuptools"])


def test_the_tests_run_on_the_pinned_versions() -> None:
    """scripts/test.sh installs with the constraints, so what is tested is what the image gets."""
    pinned = pins()
    installed = {name: importlib.metadata.version(name) for name in closure()}
    differing = {name: (version, pinned[name]) for name, version in installed.items() if pinned[name] != version}
    assert not differing, f"installed here vs constraints.txt (run bash scripts/test.sh): {differing}"


def test_scripts_test_sh_installs_from_the_constraints() -> None:
    script = (ROOT / "scripts/test.sh").read_text()
    installs = [line for line in script.splitlines() if re.search(r"\bpip install\b", line)]
    assert len(installs) >= 2
    for line in installs:
        assert "-c constraints.txt" in line, line
    assert '-e ".[test]"' in script
    # README's test command is still the script.
    assert "bash scripts/test.sh" in (ROOT / "README.md").read_text()
