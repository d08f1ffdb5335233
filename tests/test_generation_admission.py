"""Every route that generates passes admission: on a spent budget no route of the app, whatever the
body asks for (a turn, compaction on demand, a compaction trigger, Anthropic's compaction, a turn
past its compaction threshold), makes the engine generate.

The routes are enumerated from the app itself, so a route added later is tried too; the upstream
is the vLLM-faithful fake behind a recorder that counts every request reaching a generation path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, steady_window_s

KEY = "sk-acme"
MODEL = "fake-model"
# What does not make the engine generate (embeddings pool, they produce no tokens).
NOT_GENERATION = (
    "/v1/models",
    "/v1/embeddings",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",
    "/health",
)


class RecordingUpstream:
    """The fake vLLM, with every path it is asked for recorded."""

    def __init__(self) -> None:
        self.inner = create_fake_app(FakeBackendConfig())
        self.paths: list[str] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            with self.lock:
                self.paths.append(scope["path"])
        await self.inner(scope, receive, send)

    def generated(self) -> list[str]:
        with self.lock:
            return [p for p in self.paths if p not in NOT_GENERATION]


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[LiveServer, RecordingUpstream]]:
    recorder = RecordingUpstream()
    server = LiveServer(recorder).start()
    yield server, recorder
    server.stop()


CONVERSATION = [
    {"role": "user", "content": "How do I drill into brick? " * 40},
    {"role": "assistant", "content": "Use a masonry bit and go slowly. " * 40},
    {"role": "user", "content": "And into tiles?"},
]
GENERIC = {
    "model": MODEL,
    "messages": CONVERSATION,
    "input": CONVERSATION,
    "prompt": "How do I drill into brick?",
    "max_tokens": 64,
    "max_output_tokens": 64,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "anthropic compaction": {"compaction": {"type": "summarize"}},
    "compaction trigger": {"input": [*CONVERSATION, {"type": "compaction_trigger"}]},
    "responses past threshold": {"context_management": [{"type": "compaction", "compact_threshold": 10}]},
    "messages past threshold": {
        "context_management": {
            "edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 10}}]
        }
    },
}


def _post_routes(app: Any) -> list[str]:
    paths = []
    for route in app.router.routes:
        if isinstance(route, Route) and "POST" in (route.methods or ()) and "{path" not in route.path:
            paths.append(route.path.replace("{response_id}", "resp_1"))
    return paths


def test_no_route_generates_on_a_spent_budget(
    make_proxy: Callable[..., LiveServer], upstream: tuple[LiveServer, RecordingUpstream]
) -> None:
    server, recorder = upstream
    # A budget of 20 tokens: no generation fits in it, as on a budget that is spent.
    tenants = [
        {"name": "acme", "api_key": KEY, "budget": {"tenant_tokens_per_window": 20, "window_s": steady_window_s()}}
    ]
    settings = {"upstream": server.url + "/v1", "tenants": tenants}
    proxy = make_proxy(**settings)
    app = create_app(Settings(**settings))
    routes = _post_routes(app)
    # The pass-through's generation routes too (refused while budgets govern generation).
    routes += list(app.state.proxy.settings.routes.ungoverned_generation)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/responses/compact"} <= set(
        routes
    )
    answers: dict[tuple[str, str], int] = {}
    for path in routes:
        for variant, fields in VARIANTS.items():
            before = len(recorder.generated())
            response = httpx.post(
                proxy.url + path,
                json={**GENERIC, **fields},
                headers={"authorization": f"Bearer {KEY}", "x-api-key": KEY},
                timeout=60,
            )
            answers[(path, variant)] = response.status_code
            reached = recorder.generated()[before:]
            assert not reached, f"{path} ({variant}) made the engine generate on a spent budget: {reached}"
    # The generation routes were refused (by the budget itself, most of them); only routes that do
    # not generate (token counts, embeddings) answered.
    served = {key for key, status in answers.items() if status == 200}
    assert {path for path, _ in served} <= set(NOT_GENERATION), served
    assert answers[("/v1/responses/compact", "plain")] == 429


def test_compaction_on_demand_is_charged_and_refused_once_spent(
    make_proxy: Callable[..., LiveServer], upstream: tuple[LiveServer, RecordingUpstream]
) -> None:
    server, _ = upstream
    tenants = [
        {"name": "acme", "api_key": KEY, "budget": {"tenant_tokens_per_window": 12_000, "window_s": steady_window_s()}}
    ]
    proxy = make_proxy(upstream=server.url + "/v1", tenants=tenants)
    statuses, spent = [], 0
    for _ in range(12):
        response = httpx.post(
            proxy.url + "/v1/responses/compact",
            json={"model": MODEL, "input": CONVERSATION},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        statuses.append(response.status_code)
        if response.status_code != 200:
            break
        usage = response.json()["usage"]
        spent += usage["input_tokens"] + usage["output_tokens"]
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert spent <= 12_000, f"{spent} of 12,000 spent by compactions ({statuses})"
