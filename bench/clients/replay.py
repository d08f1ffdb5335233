"""A recorded client session, saved into the repo and replayed without the client.

``save`` keeps the requests a client sent in one run (a direct run's backend recorder: what the client
sent, before the bench's reply hook), their paths, bodies and the headers that can matter (no
credentials, no transport headers). ``replay`` sends them, in order, to a fresh fake vLLM directly
or through a fresh in-process proxy (``create_app`` on its defaults, served by uvicorn), with the
bench's reply hook between the proxy and the backend (``run.text_reply``: the fake answers what it
answered when the session was recorded, so the history the client re-sent is the backend's own
bytes), and reports the backend's prefill, the requests with text the client did not send and the
units of the client's text that arrived torn (``audit``)::

    python -m bench.clients.replay save bench/clients/.work/logs/run-*/continue-cli-edits-direct.exchanges.json \\
        tests/recorded/continue-cli-edits.json --client continue-cli --version 1.5.47 --scenario edits
    python -m bench.clients.replay tests/recorded/continue-cli-edits.json    # direct and through the proxy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.clients.audit import audit, torn_units
from bench.clients.recorder import Exchange, Recorder
from bench.clients.run import GENERATION_PATHS, text_reply
from bench.real_vllm.engine import parse_prefix_cache_counters
from testbed.fakevllm.app import create_app as create_fake_app
from testbed.fakevllm.config import FakeBackendConfig
from testbed.serving import LiveServer

# Request headers a recording keeps: what can name a session or an app; never credentials.
_KEPT_HEADERS = ("content-type", "accept", "user-agent")
_SESSIONISH = ("session", "chat-id", "conversation", "x-stainless-")


def _keep(header: str) -> bool:
    return header in _KEPT_HEADERS or any(mark in header for mark in _SESSIONISH)


def save(exchanges: Path, out: Path, *, client: str, version: str, scenario: str, note: str = "") -> int:
    """The client's requests of a run (``<client>-<scenario>-direct.exchanges.json``, or a proxied run's
    ``client`` side) into ``out``; returns how many."""
    data = json.loads(exchanges.read_text())
    sent = data.get("client") or data["backend"]
    requests = [
        {
            "method": e["method"],
            "path": e["path"],
            "headers": {k: v for k, v in e["request_headers"].items() if _keep(k)},
            "body": e["body"],
        }
        for e in sent
        if e["method"] != "HEAD"
    ]
    recording = {"client": client, "version": version, "scenario": scenario, "note": note, "requests": requests}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recording, indent=1, ensure_ascii=False) + "\n")
    return len(requests)


@dataclass
class Replay:
    """One replay of a recording: the backend's counts and the audit's findings."""

    mode: str  # direct | proxy
    requests: int = 0
    statuses: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    foreign: list[dict[str, Any]] = field(default_factory=list)
    # Text no request of the client's session held up to then (``foreign`` less a repaired window's
    # re-sent messages: ``audit(..., session=True)``).
    foreign_in_session: list[dict[str, Any]] = field(default_factory=list)
    torn: list[dict[str, Any]] = field(default_factory=list)
    backend_requests: list[dict[str, Any]] = field(default_factory=list)  # the bodies the backend got

    @property
    def prefill(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def torn_units(self) -> int:
        return sum(t["torn_count"] for t in self.torn)

    @property
    def lost_lines(self) -> int:
        return sum(t["lost_count"] for t in self.torn)


@contextlib.contextmanager
def _proxy(upstream: str) -> Iterator[str]:
    from proxy.app import create_app
    from proxy.config import Settings

    with LiveServer(create_app(Settings(upstream=upstream)), name="proxy") as server:
        yield server.url


def replay(recording: dict[str, Any], mode: str, *, model: str = "fake-model") -> Replay:
    """The recording's requests, in order, to a fresh fake vLLM directly or through a fresh proxy."""
    result = Replay(mode)
    config = FakeBackendConfig(model=model, max_model_len=262144, request_log_size=10_000)
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(LiveServer(create_fake_app(config), name="fake-vllm"))
        recorder = Recorder(backend.url, inject=text_reply, name="backend-recorder")
        upstream = stack.enter_context(LiveServer(recorder, name="backend-recorder")).url
        target = stack.enter_context(_proxy(upstream + "/v1")) if mode == "proxy" else upstream
        sent: list[Exchange] = []
        with httpx.Client(base_url=target, timeout=120.0, trust_env=False) as http:
            for seq, request in enumerate(recording["requests"]):
                body = json.dumps(request["body"], ensure_ascii=False).encode()
                headers = {**request["headers"], "content-type": "application/json"}
                response = http.request(request["method"], request["path"], content=body, headers=headers)
                exchange = Exchange(seq, request["method"], request["path"], headers, body, status=response.status_code)
                exchange.response_headers = {k.lower(): v for k, v in response.headers.items()}
                sent.append(exchange)
                result.statuses.append(response.status_code)
        counters = parse_prefix_cache_counters(httpx.get(backend.url + "/metrics", timeout=10).text)
        received = recorder.snapshot()
    result.requests = len(sent)
    result.prompt_tokens, result.cached_tokens = int(counters.queries), int(counters.hits)
    if mode == "proxy":
        by_id = {e.response_headers.get("x-request-id", ""): e for e in sent}
        pairs: list[tuple[Exchange, Exchange | None]] = [
            (b, by_id.get(b.headers.get("x-request-id", ""))) for b in received
        ]
    else:
        pairs = [(b, b) for b in received]
    result.foreign = [f.to_json() for f in audit(pairs)]
    result.foreign_in_session = [f.to_json() for f in audit(pairs, session=True)]
    result.torn = [t.to_json() for t in torn_units(pairs)]
    result.backend_requests = [
        {"path": b.path, "body": b.json_body()} for b in received if b.path.split("?")[0] in GENERATION_PATHS
    ]
    return result


def load(path: Path) -> dict[str, Any]:
    recording: dict[str, Any] = json.loads(path.read_text())
    return recording


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save"]:
        parser = argparse.ArgumentParser(prog="python -m bench.clients.replay save", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        parser.add_argument("exchanges", type=Path)
        parser.add_argument("out", type=Path)
        parser.add_argument("--client", required=True)
        parser.add_argument("--version", required=True)
        parser.add_argument("--scenario", required=True)
        parser.add_argument("--note", default="")
        args = parser.parse_args(argv[1:])
        count = save(args.exchanges, args.out, client=args.client, version=args.version, scenario=args.scenario,
                     note=args.note)  # fmt: skip
        print(f"{count} requests -> {args.out}")
        return 0
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    for name in argv:
        recording = load(Path(name))
        runs = {mode: replay(recording, mode) for mode in ("direct", "proxy")}
        direct, proxied = runs["direct"], runs["proxy"]
        ratio = proxied.prefill / direct.prefill if direct.prefill else float("nan")
        print(
            f"{recording['client']} ({recording['scenario']}, {direct.requests} requests): prefill "
            f"{direct.prefill:,} direct, {proxied.prefill:,} via the proxy ({ratio:.2f}x); text not sent by "
            f"the client: {len(proxied.foreign)}; torn units: {proxied.torn_units}; lost lines: {proxied.lost_lines}"
        )
        for finding in proxied.torn:
            print("  torn:", json.dumps(finding, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
