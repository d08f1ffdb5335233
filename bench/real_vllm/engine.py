"""Start and stop a real vLLM (CPU build) server for benchmarks and tests.

Standard library only and no vLLM import: usable from the project venv. The server runs from
`bench/real_vllm/.work/venv` (made by `setup.py`) and serves the random-weight model built by
`build_model.py`; replies are forced by `forced_reply.ForcedReplyLogitsProcessor`, so they are a pure
function of the rendered prompt (`testbed.fakevllm.replies.reply_for_prompt`).

    from bench.real_vllm.engine import RealVLLM, unavailable_reason

    if (why := unavailable_reason(install=True)) is None:
        with RealVLLM() as engine:
            engine.base_url        # "http://127.0.0.1:PORT" (the OpenAI API is under /v1)
            engine.metrics()       # PrefixCacheCounters(queries=..., hits=...)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


def _load_setup_module():  # bench/real_vllm/setup.py (standard library only), whatever sys.path is
    name = "_real_vllm_setup"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_setup = _load_setup_module()

DEFAULT_PRESET = _setup.DEFAULT_PRESET
DEFAULT_BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32 (its own default is 128)
DEFAULT_KV_SPACE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE is whole GiB
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_SERVED_MODEL_NAME = "tiny-llama"
LOGITS_PROCESSOR = "bench.real_vllm.forced_reply:ForcedReplyLogitsProcessor"
LOG_DIR = _setup.WORK / "logs"

_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


class EngineUnavailable(RuntimeError):
    """The real engine cannot be installed or started here; the message says why."""


@dataclass(frozen=True)
class PrefixCacheCounters:
    queries: float  # vllm:prefix_cache_queries_total (prompt tokens looked up)
    hits: float  # vllm:prefix_cache_hits_total (prompt tokens found cached)

    def __sub__(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - other.queries, self.hits - other.hits)


def unavailable_reason(install: bool = False, preset: str = DEFAULT_PRESET) -> str | None:
    """None when `RealVLLM(preset=preset)` can start; else a one-line reason.

    With `install=True`, runs whatever part of `setup.py` is missing first (several minutes the first
    time) and reports its failure as the reason.
    """
    blocker = _setup.install_blocker()
    if blocker:
        return blocker
    if install:
        try:
            _setup.ensure_setup([preset], log=lambda msg: print(msg, file=sys.stderr, flush=True))
        except _setup.SetupError as exc:
            return f"real vLLM setup failed: {exc}"
    if not _setup.venv_ready():
        return f"real vLLM is not installed: run `python3.11 {HERE / 'setup.py'}`"
    if not _setup.model_ready(preset):
        return f"model {preset!r} is not built: run `python3.11 {HERE / 'setup.py'} --preset {preset}`"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_prefix_cache_counters(metrics_text: str) -> PrefixCacheCounters:
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in metrics_text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match["name"] in totals:
            totals[match["name"]] += float(match["value"])
    return PrefixCacheCounters(totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"])


class RealVLLM:
    """A vLLM OpenAI-compatible server subprocess on 127.0.0.1; a context manager.

    Flags: --enable-prefix-caching --enable-prompt-tokens-details --block-size BLOCK --max-model-len N
    --enable-auto-tool-choice --tool-call-parser hermes --logits-processors (forced replies)
    --dtype float32 --enforce-eager. Env: VLLM_CPU_KVCACHE_SPACE=kv_space_gib, HF_HUB_OFFLINE=1,
    VLLM_USE_V2_MODEL_RUNNER=0 (the logits processor uses the v1 runner's interface), no usage stats.
    """

    def __init__(
        self,
        port: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_space_gib: int = DEFAULT_KV_SPACE_GIB,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        *,
        preset: str = DEFAULT_PRESET,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        dtype: str = "float32",
        enforce_eager: bool = True,
        max_num_seqs: int | None = None,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        startup_timeout: float = 420.0,
        log_path: Path | None = None,
    ) -> None:
        if block_size % 32:
            raise ValueError("the CPU attention backend needs block_size to be a multiple of 32")
        self.port = port or free_port()
        self.block_size = block_size
        self.kv_space_gib = int(kv_space_gib)
        self.max_model_len = max_model_len
        self.preset = preset
        self.model = served_model_name
        self.model_dir = _setup.model_dir(preset)
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.max_num_seqs = max_num_seqs
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.startup_timeout = startup_timeout
        self.log_path = log_path or LOG_DIR / f"server-{self.port}.log"
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- addresses ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """Server root: /health, /metrics, /tokenize; the OpenAI API is under /v1."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # -- command line ------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [
            str(_setup.VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes",
            "--logits-processors", LOGITS_PROCESSOR,
        ]  # fmt: skip
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.max_num_seqs:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(
            {
                "PYTHONPATH": str(REPO_ROOT),  # the logits processor and testbed.fakevllm
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib),
                "VLLM_USE_V2_MODEL_RUNNER": "0",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        env.update(self.extra_env)
        return env

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> RealVLLM:
        reason = unavailable_reason(install=False, preset=self.preset)
        if reason:
            raise EngineUnavailable(reason)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for the SIGKILL fallback
            )
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineUnavailable(
                    f"vLLM exited with code {self._proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(0.5)
        raise EngineUnavailable(
            f"vLLM not healthy after {self.startup_timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server (it stops its engine-core and worker children) and wait; SIGKILL the
        process group if it is still there after `timeout`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # Children left behind (they share the group) would keep the port and the KV memory.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> RealVLLM:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- observation -------------------------------------------------------------------------
    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "".join(text.splitlines(keepends=True)[-lines:])

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode("utf-8"))

    def metrics(self) -> PrefixCacheCounters:
        """Prefix-cache counters from /metrics, summed over label sets."""
        return parse_prefix_cache_counters(self.metrics_text())

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids vLLM hashes for this chat request (POST /tokenize)."""
        body: dict[str, object] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        req = urllib.request.Request(
            self.base_url + "/tokenize",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return list(json.loads(resp.read())["tokens"])
