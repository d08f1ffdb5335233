"""The container image's steps, run without a container builder (none on the CI machine: no Docker
daemon, no registry for the base image): what the Dockerfile copies builds into wheels, those wheels
install with no index into a fresh environment, and the installed command answers as the image's
entrypoint would, configured through the image's environment. Not checked here: the base image, the
user and the HEALTHCHECK (tests/test_deploy.py checks the Dockerfile's text)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from proxy import __version__

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_copies() -> list[str]:
    """The build stage's ``COPY <sources> <dest>`` sources (paths in the repository)."""
    sources: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        match = re.match(r"COPY\s+(?!--)(.+)\s+\S+$", line.strip())
        if match:
            sources += match.group(1).split()
    return sources


def image_environment() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().split("FROM python:${PYTHON_VERSION}-slim\n", 1)[1]
    block = re.search(r"ENV ((?:.*\\\n)*.*)", text)
    assert block is not None
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


def run(args: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, **options)  # type: ignore[call-overload,no-any-return]


def test_the_image_steps_build_install_and_run(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for source in dockerfile_copies():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, context / source)
    wheels = tmp_path / "wheels"
    built = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), "."], cwd=context)
    if built.returncode != 0 and "No matching distribution" in built.stderr + built.stdout:
        pytest.skip(f"the package index is unreachable: {built.stderr.strip().splitlines()[-1:]}")
    assert built.returncode == 0, built.stderr[-2000:]
    target = tmp_path / "image-venv"
    venv.EnvBuilder(with_pip=True).create(target)
    python = target / "bin" / "python"
    installed = run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels), "prefix-proxy"]
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    command = str(target / "bin" / "prefix-proxy")
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")}
    environment = {**clean, **image_environment(), "PATH": f"{target / 'bin'}:{clean.get('PATH', '')}"}
    version = run([command, "--version"], env=environment, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"prefix-proxy {__version__}"
    effective = run([command, "check-config"], env=environment, cwd=tmp_path)
    assert effective.returncode == 0, effective.stderr
    assert 'host = "0.0.0.0"  [PREFIX_PROXY_HOST]' in effective.stdout
    assert "port = 8080  [PREFIX_PROXY_PORT]" in effective.stdout
    # The installed package stands alone: nothing of this checkout on its path.
    where = run([str(python), "-c", "import proxy; print(proxy.__file__)"], env=environment, cwd=tmp_path)
    assert str(target) in where.stdout and str(ROOT) not in where.stdout
