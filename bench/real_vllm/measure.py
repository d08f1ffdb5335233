"""Measure the real engine on this machine: start-up, cold vs cached prefill, decode speed, and the
reuse of a generated answer on the next chat turn.

    .venv/bin/python bench/real_vllm/measure.py [--preset tiny] [--tokens 2048] [--json out.json]

Runs from the project venv (httpx); needs `setup.py` done for the preset.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.real_vllm.engine import DEFAULT_PRESET, RealVLLM, unavailable_reason

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
    "cache",
    "block",
    "prefix",
    "token",
]


def make_prompt(engine: RealVLLM, client: httpx.Client, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    text = ""
    while True:
        text += " ".join(rng.choice(WORDS) for _ in range(200)) + "\n"
        count = client.post("/tokenize", json={"model": engine.model, "prompt": text}).json()["count"]
        if count >= n_tokens:
            return text


def completion(engine: RealVLLM, client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, dict]:
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    resp = client.post("/v1/completions", json=body)
    resp.raise_for_status()
    return time.perf_counter() - t0, resp.json()["usage"]


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def run(preset: str, n_tokens: int, repeats: int, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": preset, "prompt_tokens_target": n_tokens, "env": env}
    engine_ = RealVLLM(preset=preset, extra_env=env)
    with engine_ as engine, httpx.Client(base_url=engine.base_url, timeout=600) as client:
        out["startup_s"] = round(engine.startup_seconds or 0, 1)
        completion(engine, client, "warm up", 1)  # first request pays one-off costs
        cold, warm = [], []
        for i in range(repeats):
            prompt = make_prompt(engine, client, n_tokens, seed=i)
            dt, usage = completion(engine, client, prompt, 1)
            assert cached(usage) == 0, usage
            cold.append(dt)
            dt, usage = completion(engine, client, prompt, 1)
            assert cached(usage) > 0, usage
            warm.append(dt)
        out["prompt_tokens"] = usage["prompt_tokens"]
        out["cold_prefill_s"] = round(statistics.median(cold), 3)
        out["cached_prefill_s"] = round(statistics.median(warm), 3)
        dt, usage = completion(engine, client, "decode speed", 101)
        dt1, _ = completion(engine, client, "decode speed", 1)
        out["decode_ms_per_token"] = round(1000 * (dt - dt1) / 100, 1)

        # Turn 2 re-sends turn 1's answer verbatim: vLLM cached the generated tokens' blocks too.
        system = " ".join(random.Random(99).choice(WORDS) for _ in range(800))
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about caches."}]
        r1 = client.post("/v1/chat/completions", json={"model": engine.model, "messages": turn1}).json()
        answer = r1["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        r2 = client.post("/v1/chat/completions", json={"model": engine.model, "messages": turn2}).json()
        out["multi_turn"] = {
            "turn1_prompt_tokens": r1["usage"]["prompt_tokens"],
            "turn1_completion_tokens": r1["usage"]["completion_tokens"],
            "turn2_prompt_tokens": r2["usage"]["prompt_tokens"],
            "turn2_cached_tokens": cached(r2["usage"]),
        }
        out["prefix_cache_counters"] = engine.metrics().__dict__
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = parser.parse_args()
    why = unavailable_reason(install=False, preset=args.preset)
    if why:
        sys.exit(f"real vLLM unavailable: {why}")
    result = run(args.preset, args.tokens, args.repeats, dict(kv.split("=", 1) for kv in args.env))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
