"""The prefix-proxy command: an OpenAI-compatible proxy that makes vLLM's prefix cache hit.

Configuration problems are one line each on stderr, naming the file key, flag or variable, and the
command exits 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from proxy import __version__

EXIT_CONFIG_ERROR = 2

# `prefix-proxy demo`'s defaults (testbed.demo.run_demo takes the same).
DEMO_SESSIONS = 32
DEMO_SEED = 0
DEMO_CONCURRENCY = 8


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    upstreams = getattr(args, "upstream", None) or []
    return {
        "upstream": upstreams[0] if len(upstreams) == 1 else None,
        "upstreams": upstreams if len(upstreams) > 1 else None,
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
    }


def _serve(args: argparse.Namespace) -> int:
    if hasattr(signal, "SIGHUP"):
        # Until the server's own handler is in place (its lifespan), a SIGHUP (a config reload sent
        # early) must not end the process: SIGHUP's default action terminates.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from proxy.observability import configure_logging
    from proxy.preflight import load_settings
    from proxy.serve import serve

    settings = load_settings(args.config, **_flags(args))
    configure_logging(settings.log_level)
    serve(settings, reload=lambda: load_settings(args.config, **_flags(args)))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from proxy.preflight import check_settings

    lines, problems, notes = check_settings(args.config, **_flags(args))
    for line in lines:
        print(line)
    for note in notes:
        print(f"prefix-proxy: note: {note}", file=sys.stderr)
    if problems:
        for problem in problems:
            print(f"prefix-proxy: {problem}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print("config OK", file=sys.stderr)
    return 0


# Only `demo` and `fake-backend` use the development tooling (testbed/), and only once they run:
# building the parser and every other command (`serve` and the request path, `check-config`, `kv`,
# `ramp`, `analyze`) work in an install without it, as the container image is
# (tests/test_product_standalone.py; the import contract in pyproject.toml).
def _without_testbed(command: str, error: ModuleNotFoundError) -> int:
    if error.name != "testbed":
        raise error
    print(
        f"prefix-proxy {command}: needs the development tooling (testbed/), which this install does not carry; "
        "run it from a checkout (pip install -e .) or the image's fake-backend target",
        file=sys.stderr,
    )
    return EXIT_CONFIG_ERROR


def _fake_backend(args: argparse.Namespace) -> int:
    try:
        from testbed.fakevllm import FakeBackendConfig, serve
    except ModuleNotFoundError as error:
        return _without_testbed("fake-backend", error)

    config = FakeBackendConfig(
        model=args.model,
        block_size=args.block_size,
        cache_capacity_blocks=args.capacity_blocks,
        max_model_len=args.max_model_len,
        tokenizer_path=args.tokenizer,
        prefill_seconds_per_token=args.prefill_ms_per_1k_tokens / 1e6,
        seconds_per_output_token=args.ms_per_output_token / 1e3,
    )
    serve(config, args.host, args.port)
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        from testbed.demo import run_from_args
    except ModuleNotFoundError as error:
        return _without_testbed("demo", error)

    return run_from_args(args)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, for ``prefix-proxy demo`` (and ``python -m testbed.demo``)."""
    parser.add_argument(
        "--sessions", type=int, default=DEMO_SESSIONS, help="sessions per scenario (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=DEMO_SEED, help="workload seed (default %(default)s)")
    parser.add_argument(
        "--scenarios",
        help="comma-separated scenario names (default: all default scenarios; --list shows them)",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios (* = in the default set) and exit")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument(
        "--block-size", type=int, default=16, help="prefix-cache block size of the fake backends (default 16)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=DEMO_CONCURRENCY, help="requests in flight (default %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _kv(args: argparse.Namespace) -> int:
    from proxy.capacity import describe, kv_capacity, resolve_shape

    if not args.model and not args.config_json:
        print("prefix-proxy kv: give --model (a preset, e.g. llama-3.1-8b) or --config-json FILE", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        shape = resolve_shape(args.model, args.config_json)
        print(describe(args.model, args.context, args.dtype, args.config_json))
        capacity = kv_capacity(args, shape.bytes_per_token(args.dtype))
    except (ValueError, OSError) as error:
        print(f"prefix-proxy kv: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if capacity:
        print(capacity)
    return 0


def _ramp(args: argparse.Namespace) -> int:
    from proxy.capacity import run_ramp_command

    return run_ramp_command(args)


def _analyze(args: argparse.Namespace) -> int:
    from proxy.analysis import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefix-proxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"prefix-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy in front of an OpenAI-compatible upstream")
    serve.add_argument(
        "--upstream",
        action="append",
        help="upstream base URL, e.g. http://127.0.0.1:8000/v1; repeat for several backends",
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1; setting host)")
    serve.add_argument("--port", type=int, help="listen port (default 8080; setting port)")
    serve.add_argument("--config", help="YAML or TOML config file (env PREFIX_PROXY_CONFIG)")
    serve.set_defaults(handler=_serve)

    check = commands.add_parser(
        "check-config",
        help="print the effective settings (secrets masked) and where each came from; exit 2 on any problem",
    )
    check.add_argument("--config", help="YAML or TOML config file (env PREFIX_PROXY_CONFIG)")
    check.add_argument("--upstream", action="append", help="as serve --upstream")
    check.add_argument("--host", help="as serve --host")
    check.add_argument("--port", type=int, help="as serve --port")
    check.set_defaults(handler=_check_config)

    fake = commands.add_parser("fake-backend", help="run the bundled vLLM-faithful test backend")
    fake.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    fake.add_argument("--port", type=int, default=8000, help="listen port (default %(default)s)")
    fake.add_argument("--model", default="fake-model", help="the served model's name (default %(default)s)")
    fake.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default %(default)s)")
    fake.add_argument(
        "--capacity-blocks", type=int, default=65536, help="KV blocks in the prefix cache (default %(default)s)"
    )
    fake.add_argument("--max-model-len", type=int, default=32768, help="context length in tokens (default %(default)s)")
    fake.add_argument("--tokenizer", help="path to a Hugging Face tokenizer.json (default: bundled cl100k)")
    fake.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="simulated prefill time per 1,000 computed tokens (default %(default)s: instant)",
    )
    fake.add_argument(
        "--ms-per-output-token", type=float, default=0.0, help="simulated decode time per token (default %(default)s)"
    )
    fake.set_defaults(handler=_fake_backend)

    demo = commands.add_parser(
        "demo", help="no setup: run a Dify-style workload directly and through the proxy, print hit rates"
    )
    add_demo_arguments(demo)
    demo.set_defaults(handler=_demo)

    kv = commands.add_parser("kv", help="KV-cache bytes a context costs on a model")
    kv.add_argument("--model", help="preset name, e.g. llama-3.1-8b, qwen2.5-72b")
    kv.add_argument("--config-json", help="a Hugging Face config.json instead of a preset")
    kv.add_argument("--context", type=int, default=131072, help="tokens")
    kv.add_argument("--dtype", default="fp16", help="fp16, bf16, fp8, int8, fp32")
    from proxy.capacity import add_kv_capacity_arguments, add_ramp_arguments

    add_kv_capacity_arguments(kv)
    kv.set_defaults(handler=_kv)

    ramp = commands.add_parser(
        "ramp", help="ramp input length and concurrency against a backend: TTFT, KV pressure, critical context"
    )
    add_ramp_arguments(ramp)
    ramp.set_defaults(handler=_ramp)

    from proxy.analysis import add_arguments as add_analyze_arguments

    analyze = commands.add_parser(
        "analyze", help="replay a capture (capture.path) through each canonicalization mode: predicted savings"
    )
    add_analyze_arguments(analyze)
    analyze.set_defaults(handler=_analyze)

    return parser


# Read by prometheus_client when it is imported: values kept in files of that folder, for a server
# of several worker processes (base images for gunicorn apps set it). The proxy is one process and
# keeps its metrics in memory; read, the variable made serve fail on a missing or read-only folder.
# Unset before anything imports prometheus_client (the parser imports the commands).
PROMETHEUS_MULTIPROCESS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def main(argv: Sequence[str] | None = None) -> int:
    from proxy.config_sources import ConfigError

    for name in PROMETHEUS_MULTIPROCESS_VARIABLES:
        if os.environ.pop(name, None) is not None:
            print(f"prefix-proxy: note: {name} is not read: the proxy is one process and keeps its metrics in memory",
                  file=sys.stderr)  # fmt: skip
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as error:
        for problem in error.problems:
            print(f"prefix-proxy: {problem}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
