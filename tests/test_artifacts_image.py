"""The container image offers what CI tests, read from the Dockerfile's text (no container builder here):
a pinned base image of the Python CI runs, the dependencies built before any source is copied and from
constraints.txt (the versions CI installs), and the ``otel`` extra in the product image, so the Helm chart's
``config.tracing.enabled: true`` starts instead of refusing to. tests/test_image_steps.py runs the same steps
outside a container; the compose file's published ports are checked here too."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from tests.test_deploy import (
    COMPOSE,
    ROOT,
    base_image,
    copied_sources,
    dockerfile_args,
    dockerfile_stages,
    named_stages,
    stage_chain,
    stage_inputs,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# An exact release (3.11.7, not 3.11 or 3) and the digest of its image: what a rebuild pulls cannot move.
PINNED_PYTHON = re.compile(r"python:(?P<version>3\.\d+\.\d+)-slim-\w+@sha256:[0-9a-f]{64}")


def runs(stage: str) -> list[str]:
    """The shell of each ``RUN`` of ``stage`` (not of the stages it is FROM)."""
    return [" ".join(c.value) for c in named_stages()[stage][1:] if c.cmd.upper() == "RUN"]


def stage_args(stage: str) -> dict[str, str]:
    """The build arguments a stage's RUN sees: those it declares, with the global defaults."""
    declared = {
        c.value[0].partition("=")[0]: c.value[0].partition("=")[2]
        for s in stage_chain(stage)
        for c in s[1:]
        if c.cmd.upper() == "ARG"
    }
    return {name: default or dockerfile_args().get(name, "") for name, default in declared.items()}


def pip_commands(shell: str) -> list[list[str]]:
    """Each ``pip install``/``pip wheel`` of a RUN, as its words."""
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words[:1] == ["pip"]]


def test_the_base_image_is_pinned_by_exact_version_and_digest() -> None:
    bases = {base_image(stage) for stage in named_stages()} - set(named_stages())
    assert bases == {dockerfile_args()["PYTHON_IMAGE"]}, "every stage builds on the one pinned Python image"
    (image,) = bases
    assert PINNED_PYTHON.fullmatch(image), f"{image}: pin an exact Python release and its digest"


def test_the_image_runs_the_python_ci_tests() -> None:
    """The tests run on CI's interpreter (3.11): the image's Python is the same minor release, as are the
    versions the type checker and the linter check the code for."""
    match = PINNED_PYTHON.fullmatch(dockerfile_args()["PYTHON_IMAGE"])
    assert match is not None
    image_minor = tuple(int(part) for part in match["version"].split(".")[:2])
    assert image_minor == sys.version_info[:2], (
        f"the image runs Python {match['version']}, the tests run on {sys.version.split()[0]}"
    )
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "{}.{}".format(*image_minor)
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py{}{}".format(*image_minor)
    assert PYPROJECT["project"]["requires-python"] == ">={}.{}".format(*image_minor)


def test_the_dependencies_are_built_before_any_source_is_copied() -> None:
    """The stage that builds the dependencies' wheels sees pyproject.toml (through the requirements list)
    and constraints.txt only: a change to proxy/ or summarizer/ leaves its layer cached."""
    (deps,) = [name for name in named_stages() if any("-r requirements.txt" in shell for shell in runs(name))]
    assert copied_sources(stage_inputs(deps)) == {"pyproject.toml", "constraints.txt"}
    build = next(name for name in named_stages() if "proxy" in copied_sources({name}))
    assert deps in stage_inputs(build), "the sources are copied onto the dependencies' stage"
    # In the file's order too: the dependencies' wheels, then the first source.
    commands = [c for stage in dockerfile_stages() for c in stage]
    first_source = next(i for i, c in enumerate(commands) if c.cmd.upper() == "COPY" and "proxy" in c.value[:-1])
    wheels = next(i for i, c in enumerate(commands) if c.cmd.upper() == "RUN" and "-r requirements.txt" in c.value[0])
    assert wheels < first_source


def test_every_pip_step_that_reads_an_index_is_constrained() -> None:
    """Whatever pip fetches from the index comes at constraints.txt's version; the rest installs from the
    wheels built so (--no-index) or builds the project alone (--no-deps)."""
    steps = [words for stage in named_stages() for shell in runs(stage) for words in pip_commands(shell)]
    assert len(steps) >= 5
    for words in steps:
        if "--no-index" in words or "--no-deps" in words:
            continue
        assert "-c" in words and words[words.index("-c") + 1] == "constraints.txt", " ".join(words)


def test_the_proxy_image_installs_the_otel_extra_by_default() -> None:
    """``tracing.enabled: true`` needs the ``otel`` extra (else the proxy refuses to start, exit 2): the
    product image installs it unless built with ``--build-arg PROXY_EXTRAS=``."""
    assert "otel" in PYPROJECT["project"]["optional-dependencies"]
    assert dockerfile_args()["PROXY_EXTRAS"].split(",") == ["otel"]
    assert stage_args("proxy")["PROXY_EXTRAS"] == "otel"
    (install,) = [words for shell in runs("proxy") for words in pip_commands(shell)]
    assert install[-1] == "prefix-proxy${PROXY_EXTRAS:+[${PROXY_EXTRAS}]}"
    expand = f'printf %s "{install[-1]}"'  # as the RUN's shell expands it
    shell = subprocess.run(
        ["sh", "-c", expand],
        env={**os.environ, **stage_args("proxy")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shell.stdout == "prefix-proxy[otel]"
    without = subprocess.run(["sh", "-c", expand], env={"PROXY_EXTRAS": ""}, capture_output=True, text=True)
    assert without.stdout == "prefix-proxy"


def requirements_list(tmp_path: Path, extras: str) -> list[str]:
    """What the Dockerfile's requirements stage writes, by running its RUN on pyproject.toml."""
    (shell,) = runs("requirements")
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {**os.environ, **stage_args("requirements"), "PROXY_EXTRAS": extras}
    subprocess.run(["sh", "-c", shell], cwd=tmp_path, env=env, check=True)
    return (tmp_path / "requirements.txt").read_text().splitlines()


def test_the_requirements_stage_lists_the_dependencies_and_the_extras(tmp_path: Path) -> None:
    project = PYPROJECT["project"]
    default = requirements_list(tmp_path, stage_args("requirements")["PROXY_EXTRAS"])
    assert default == [*project["dependencies"], *project["optional-dependencies"]["otel"]]
    assert requirements_list(tmp_path, "") == project["dependencies"]


# -- compose ----------------------------------------------------------------------------------------


def compose_ports() -> dict[str, list[Any]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {name: service["ports"] for name, service in services.items() if "ports" in service}


def test_compose_publishes_on_localhost_unless_told_otherwise() -> None:
    """The proxy without tenants is open, Grafana's password defaults to admin: published ports listen on
    127.0.0.1 unless BIND_ADDRESS says another address."""
    published = compose_ports()
    assert {"proxy", "grafana", "prometheus"} <= set(published)
    for service, ports in published.items():
        for port in ports:
            assert isinstance(port, str) and port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), f"{service}: {port}"
    env_example = (COMPOSE.parent / ".env.example").read_text()
    assert re.search(r"^# BIND_ADDRESS=127\.0\.0\.1$", env_example, re.MULTILINE)


def test_compose_topologies_publish_nothing_more() -> None:
    for path in sorted((COMPOSE.parent / "compose").glob("*.yml")):
        services = yaml.safe_load(path.read_text())["services"]
        assert not [name for name, service in services.items() if "ports" in service], path.name
