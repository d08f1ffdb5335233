"""The container image's steps, run without a container builder (none on the CI machine: no Docker
daemon, no registry for the base image): the RUN commands of the Dockerfile's build stages, as written, in a
fresh environment of this Python (CI's, the image's minor release) on what those stages copy: the
requirements list from pyproject.toml, the dependencies' wheels at constraints.txt's versions, the project's
wheel. Then the product stage's own install step (no index, the ``otel`` extra by default) into another fresh
environment; the installed command answers as the image's entrypoint would, configured through the image's
environment, with no testbed in it, with OpenTelemetry (``tracing.enabled: true`` starts), and every package
at the version CI tests. The fake-backend target's steps likewise: the project's wheel again with testbed/, in
place of the product's, installs beside the same dependencies and serves. Not checked here: the base image,
the user and the HEALTHCHECK (tests/test_deploy.py and tests/test_artifacts_image.py check the Dockerfile's
text)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from proxy import __version__
from tests.helpers import free_port
from tests.test_artifacts_constraints import pins
from tests.test_artifacts_image import runs, stage_args
from tests.test_deploy import copied_sources, named_stages, stage_chain, stage_inputs

ROOT = Path(__file__).resolve().parents[1]
PROJECT_WHEEL = "prefix_proxy-*.whl"
WHEELS = "/wheels"  # where the Dockerfile's stages keep the wheels


def image_environment(target: str) -> dict[str, str]:
    """Every ``ENV`` of a target and of the stages it is FROM."""
    environment: dict[str, str] = {}
    for stage in stage_chain(target):
        for command in stage:
            if command.cmd.upper() == "ENV":
                environment.update(zip(command.value[0::2], command.value[1::2], strict=True))
    return environment


def run(args: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, **options)  # type: ignore[call-overload,no-any-return]


def build_context(target: str, context: Path) -> Path:
    """What the target's stages COPY from the repository (the build context they see)."""
    context.mkdir()
    for source in copied_sources(stage_inputs(target)):
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, context / source)
    return context


def python_environment(target: Path) -> Path:
    """A fresh environment of this Python, with the pip it bundles (as the base image has); its bin/ folder."""
    venv.EnvBuilder(with_pip=True).create(target)
    return target / "bin"


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith(("PREFIX_PROXY_", "PIP_", "VIRTUAL_ENV"))}


def run_stage(stage: str, cwd: Path, bin_dir: Path, wheels: Path) -> list[subprocess.CompletedProcess[str]]:
    """The stage's own RUN commands as the Dockerfile writes them, with its ENV and build arguments, the
    environment's ``bin_dir`` first on PATH and ``wheels`` for /wheels. pip's cache stays on (the image
    turns it off for its size only)."""
    environment = {
        **clean_environment(),
        **{k: v for k, v in image_environment(stage).items() if k != "PIP_NO_CACHE_DIR"},
        **stage_args(stage),
    }
    environment["PATH"] = f"{bin_dir}:{environment.get('PATH', '')}"
    done = []
    for shell in runs(stage):
        result = run(["sh", "-c", shell.replace(WHEELS, str(wheels))], cwd=cwd, env=environment)
        if result.returncode != 0 and "No matching distribution" in result.stderr + result.stdout:
            pytest.skip(f"the package index is unreachable: {result.stderr.strip().splitlines()[-1:]}")
        assert result.returncode == 0, f"RUN {shell}\n{result.stderr[-3000:]}"
        done.append(result)
    return done


def image_env(target: str, bin_dir: Path) -> dict[str, str]:
    clean = clean_environment()
    return {**clean, **image_environment(target), "PATH": f"{bin_dir}:{clean.get('PATH', '')}"}


@dataclass(frozen=True)
class Build:
    """What the product's build stages left: their context, environment (its bin/) and wheels."""

    context: Path
    bin_dir: Path
    wheels: Path


@pytest.fixture(scope="module")
def product_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The stages the product's wheels come from (``build`` and those it is FROM or copies from), in the
    Dockerfile's order, on the product's context."""
    work = tmp_path_factory.mktemp("image")
    context = build_context("proxy", work / "context")
    assert not (context / "testbed").exists()
    build = Build(context, python_environment(work / "build-env"), work / "wheels")
    for stage in (name for name in named_stages() if name in stage_inputs("build")):
        run_stage(stage, context, build.bin_dir, build.wheels)
    return build


def installed_versions(bin_dir: Path) -> dict[str, str]:
    listed = run([str(bin_dir / "python"), "-m", "pip", "list", "--format=freeze"])
    assert listed.returncode == 0, listed.stderr
    lines = (line.partition("==") for line in listed.stdout.split())
    return {canonicalize_name(name): version for name, _, version in lines}


def test_the_image_steps_build_install_and_run(product_build: Build, tmp_path: Path) -> None:
    bin_dir = python_environment(tmp_path / "image-venv")
    run_stage("proxy", tmp_path, bin_dir, product_build.wheels)
    python, command = str(bin_dir / "python"), str(bin_dir / "prefix-proxy")
    environment = image_env("proxy", bin_dir)
    # Every package at the version CI installs (constraints.txt); the project's own besides.
    versions = installed_versions(bin_dir)
    pinned = pins()
    assert versions.pop("prefix-proxy") == __version__
    assert "opentelemetry-sdk" in versions
    # (pip and setuptools are the interpreter's own, as in the base image: nothing is built there)
    differing = {
        name: (version, pinned.get(name))
        for name, version in versions.items()
        if name not in ("pip", "setuptools") and pinned.get(name) != version
    }
    assert not differing, f"installed in the image vs constraints.txt: {differing}"
    # The otel extra: tracing starts (check-config runs the checks serve runs, the import of the exporter too).
    tracing = run([command, "check-config"], env={**environment, "PREFIX_PROXY_TRACING__ENABLED": "true"}, cwd=tmp_path)
    assert tracing.returncode == 0, tracing.stderr
    assert "tracing.enabled = true  [PREFIX_PROXY_TRACING__ENABLED]" in tracing.stdout
    version = run([command, "--version"], env=environment, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"prefix-proxy {__version__}"
    effective = run([command, "check-config"], env=environment, cwd=tmp_path)
    assert effective.returncode == 0, effective.stderr
    assert 'host = "0.0.0.0"  [PREFIX_PROXY_HOST]' in effective.stdout
    assert "port = 8080  [PREFIX_PROXY_PORT]" in effective.stdout
    # The installed package stands alone: nothing of this checkout on its path.
    where = run([python, "-c", "import proxy; print(proxy.__file__)"], env=environment, cwd=tmp_path)
    assert str(tmp_path) in where.stdout and str(ROOT) not in where.stdout
    # ... and without the development tooling: no testbed, the commands that need it say so in a line.
    tooling = run([python, "-c", "import testbed"], env=environment, cwd=tmp_path)
    assert tooling.returncode != 0 and "No module named 'testbed'" in tooling.stderr
    for needs_testbed in ("demo", "fake-backend"):
        refused = run([command, needs_testbed], env=environment, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert refused.stderr.startswith(f"prefix-proxy {needs_testbed}: needs the development tooling (testbed/)")
        assert "Traceback" not in refused.stderr
    analyze = run([command, "analyze", "--help"], env=environment, cwd=tmp_path)
    assert analyze.returncode == 0 and "capture" in analyze.stdout


def test_the_fake_backend_target_steps_install_and_serve(product_build: Build, tmp_path: Path) -> None:
    # build-fake-backend: the same context plus testbed/, its project wheel replacing the product's.
    context = build_context("fake-backend", tmp_path / "context")
    assert (context / "testbed").is_dir()
    wheels = tmp_path / "wheels"
    shutil.copytree(product_build.wheels, wheels)
    run_stage("build-fake-backend", context, product_build.bin_dir, wheels)
    assert len(list(wheels.glob(PROJECT_WHEEL))) == 1
    bin_dir = python_environment(tmp_path / "fake-venv")
    run_stage("fake-backend", tmp_path, bin_dir, wheels)
    environment = image_env("fake-backend", bin_dir)
    tooling = run([str(bin_dir / "python"), "-c", "import testbed.fakevllm, proxy.enginemodel"], env=environment)
    assert tooling.returncode == 0, tooling.stderr
    port = free_port()
    server = subprocess.Popen(
        [str(bin_dir / "prefix-proxy"), "fake-backend", "--host", "127.0.0.1", "--port", str(port)],
        env=environment,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    assert response.status == 200
                break
            except OSError:
                assert server.poll() is None, server.communicate()[1][-2000:]
                assert time.monotonic() < deadline, "the fake backend did not answer /health"
                time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(timeout=10)
