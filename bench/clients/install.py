"""Installing the clients from their registries into ``bench/clients/.work`` (cached: a re-run is quick).

npm packages go to ``.work/npm/<client>`` (``npm install --prefix``), PyPI packages to their own
virtual environment ``.work/venv-<client>``. Each install returns the executable, or raises
``Unavailable`` with the reason (no npm, registry unreachable, the package failed to build).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

WORK = Path(__file__).resolve().parent / ".work"


class Unavailable(RuntimeError):
    """The client cannot be installed or run here; the message says why."""


def _log(name: str) -> Path:
    path = WORK / "logs" / f"install-{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _run(args: list[str], name: str, timeout: float, env: dict[str, str] | None = None) -> None:
    log = _log(name)
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        try:
            proc = subprocess.run(
                args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env={**os.environ, **(env or {})}
            )
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"{name}: `{args[0]} ...` took over {timeout:.0f} s (log: {log})") from exc
        out.write(f"rc={proc.returncode} seconds={time.monotonic() - started:.1f}\n")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise Unavailable(f"{name}: `{' '.join(args[:3])} ...` exited {proc.returncode}: {' | '.join(tail)}")


def npm_package(name: str, package: str, executable: str, *, timeout: float = 300.0, refresh: bool = False) -> Path:
    """``package`` from npm under ``.work/npm/<name>``; returns its ``node_modules/.bin/<executable>``."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise Unavailable(f"{name}: node/npm are not installed")
    prefix = WORK / "npm" / name
    binary = prefix / "node_modules" / ".bin" / executable
    if binary.exists() and not refresh:
        return binary
    prefix.mkdir(parents=True, exist_ok=True)
    _run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package], name, timeout)
    if not binary.exists():
        raise Unavailable(f"{name}: npm installed {package} but {binary} is missing")
    return binary


def pip_package(name: str, package: str, executable: str, *, python: str | None = None, timeout: float = 900.0) -> Path:
    """``package`` from PyPI into ``.work/venv-<name>`` (made with ``python``); returns ``bin/<executable>``.
    ``package`` may name several, separated by spaces (``"langgraph==1.2.24 langchain-openai==1.8.1"``)."""
    venv = WORK / f"venv-{name}"
    binary = venv / "bin" / executable
    if binary.exists():
        return binary
    interpreter = python or find_python(("3.12", "3.11"))
    if not (venv / "bin" / "python").exists():
        _run([interpreter, "-m", "venv", str(venv)], name, 120.0)
    _run([str(venv / "bin" / "pip"), "install", "-q", *package.split()], name, timeout)
    if not binary.exists():
        raise Unavailable(f"{name}: pip installed {package} but {binary} is missing")
    return binary


def find_python(versions: tuple[str, ...]) -> str:
    """The first interpreter found among ``python<version>`` on PATH and pyenv's versions."""
    for version in versions:
        found = shutil.which(f"python{version}")
        if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
            return found
        pyenv = Path.home() / ".pyenv" / "versions"
        for candidate in sorted(pyenv.glob(f"{version}.*"), reverse=True):
            binary = candidate / "bin" / f"python{version}"
            if binary.exists():
                return str(binary)
    raise Unavailable(f"no Python {' or '.join(versions)} found")
