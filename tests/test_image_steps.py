"""The container image's steps, run without a container builder (none on the CI machine: no Docker
daemon, no registry for the base image): what the Dockerfile's product stages copy builds into wheels,
those wheels install with no index into a fresh environment, and the installed command answers as the
image's entrypoint would, configured through the image's environment, with no testbed in it. The
fake-backend target's steps likewise: the project's wheel again with testbed/, in place of the product's,
installs beside the same dependencies and serves. Not checked here: the base image, the user and the
HEALTHCHECK (tests/test_deploy.py checks the Dockerfile's text)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import venv
from pathlib import Path

import pytest

from proxy import __version__
from tests.helpers import free_port
from tests.test_deploy import copied_sources, stage_chain, stage_inputs

ROOT = Path(__file__).resolve().parents[1]
PROJECT_WHEEL = "prefix_proxy-*.whl"


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


def install(wheels: Path, target: Path) -> Path:
    """A fresh environment with prefix-proxy installed from ``wheels`` alone; its bin/ folder."""
    venv.EnvBuilder(with_pip=True).create(target)
    pip = [str(target / "bin/python"), "-m", "pip", "install", "--quiet", "--no-index"]
    installed = run([*pip, "--find-links", str(wheels), "prefix-proxy"])
    assert installed.returncode == 0, installed.stderr[-2000:]
    return target / "bin"


def image_env(target: str, bin_dir: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")}
    return {**clean, **image_environment(target), "PATH": f"{bin_dir}:{clean.get('PATH', '')}"}


@pytest.fixture(scope="module")
def product_wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build stage: ``pip wheel`` of the product's context, every dependency included."""
    work = tmp_path_factory.mktemp("image")
    context = build_context("proxy", work / "context")
    assert not (context / "testbed").exists()
    wheels = work / "wheels"
    built = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), "."], cwd=context)
    if built.returncode != 0 and "No matching distribution" in built.stderr + built.stdout:
        pytest.skip(f"the package index is unreachable: {built.stderr.strip().splitlines()[-1:]}")
    assert built.returncode == 0, built.stderr[-2000:]
    return wheels


def test_the_image_steps_build_install_and_run(product_wheels: Path, tmp_path: Path) -> None:
    bin_dir = install(product_wheels, tmp_path / "image-venv")
    python, command = str(bin_dir / "python"), str(bin_dir / "prefix-proxy")
    environment = image_env("proxy", bin_dir)
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


def test_the_fake_backend_target_steps_install_and_serve(product_wheels: Path, tmp_path: Path) -> None:
    # build-fake-backend: the same context plus testbed/, its project wheel replacing the product's.
    context = build_context("fake-backend", tmp_path / "context")
    assert (context / "testbed").is_dir()
    wheels = tmp_path / "wheels"
    shutil.copytree(product_wheels, wheels, ignore=shutil.ignore_patterns(PROJECT_WHEEL))
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), "."], cwd=context
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert len(list(wheels.glob(PROJECT_WHEEL))) == 1
    bin_dir = install(wheels, tmp_path / "fake-venv")
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
