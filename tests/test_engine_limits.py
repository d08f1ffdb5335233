"""Never stricter than the engine: what vLLM accepts directly, it accepts through the proxy.

Claude Code sends ``max_tokens: 32000``, to a 32k-context model too. vLLM 0.32 clamps it to what
the prompt leaves, so its requests are answered directly; through the proxy they must be too, and
the conversation must not count as over its context budget (which would compact it every turn).
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from proxy.app import create_app
from proxy.config import Settings
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer
from tests.test_environment_blocks import CLAUDE_CODE, COMMITS

CONTEXT = 32768


@pytest.fixture
def backend_32k() -> Iterator[LiveServer]:
    server = LiveServer(create_fake_app(FakeBackendConfig(max_model_len=CONTEXT))).start()
    yield server
    server.stop()


@pytest.fixture
def proxy_32k(backend_32k: LiveServer) -> Iterator[LiveServer]:
    server = LiveServer(create_app(Settings(upstream=backend_32k.url + "/v1"))).start()
    yield server
    server.stop()


TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "Runs the command and returns its output. " * 40,
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    }
    for name in ("Bash", "Read", "Edit", "Grep", "Glob", "Write")
]


@pytest.mark.parametrize("via_proxy", [False, True])
def test_claude_codes_max_tokens_on_a_32k_model(
    via_proxy: bool, backend_32k: LiveServer, proxy_32k: LiveServer
) -> None:
    url = proxy_32k.url if via_proxy else backend_32k.url
    client = anthropic.Anthropic(base_url=url, api_key="sk-dummy", max_retries=0)
    system = [{"type": "text", "text": CLAUDE_CODE.format(commits="\n".join(COMMITS))}]
    messages: list[anthropic.types.MessageParam] = []
    turns = ("Fix the retry logic.", "Now run the tests.", "Commit it.", "Push it.", "Open a PR.", "Tag it.", "Done?")
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        raw = client.messages.with_raw_response.create(
            model="fake-model",
            max_tokens=32000,
            system=system,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            messages=messages,
            timeout=60,  # what the SDK asks for such a max_tokens without streaming
        )
        reply = raw.parse()
        actions = raw.headers.get("x-prefix-proxy-actions", "")
        assert reply.usage.input_tokens + reply.usage.output_tokens <= CONTEXT
        assert "summary" not in actions and "compact" not in actions
        messages.append({"role": "assistant", "content": reply.content})  # type: ignore[typeddict-item]


def test_chat_with_max_tokens_past_the_context(proxy_32k: LiveServer) -> None:
    client = openai.OpenAI(base_url=proxy_32k.url + "/v1", api_key="sk-dummy", max_retries=0)
    reply = client.chat.completions.create(
        model="fake-model", max_tokens=CONTEXT, messages=[{"role": "user", "content": "Summarize the plan."}]
    )
    assert reply.usage is not None and reply.usage.total_tokens <= CONTEXT
