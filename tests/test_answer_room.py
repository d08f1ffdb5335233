"""The context budget reserves the answer's room only where the engine refuses a prompt without it:
vLLM refuses prompt + max_tokens past max_model_len; llama-server refuses only a prompt that fills
its slot's context (server-context.cpp: ``n_tokens >= n_ctx``) and stops the answer where the context
ends. A prompt llama-server would take is not compacted for the answer's room (found on a real
llama-server: an append-only chat cost 1.8x direct's prefill, its 2,000-2,047-token prompts compacted
at --ctx-size 2048)."""

from __future__ import annotations

from proxy.backends import GENERIC, refuses_answer_room
from proxy.backends.engines import LLAMA_SERVER, OLLAMA, VLLM
from proxy.chat import context_limit
from proxy.config import BudgetSettings

BODY = {"model": "m", "max_tokens": 256, "messages": [{"role": "user", "content": "hi"}]}


def test_vllm_and_unknown_engines_keep_the_answers_room() -> None:
    for kind in (VLLM, GENERIC, OLLAMA):
        assert refuses_answer_room(kind)
        assert context_limit(BudgetSettings(), 2048, BODY, answer_room=refuses_answer_room(kind)) == 2048 - 256


def test_llama_server_takes_any_prompt_shorter_than_its_context() -> None:
    assert not refuses_answer_room(LLAMA_SERVER)
    assert context_limit(BudgetSettings(), 2048, BODY, answer_room=False) == 2047


def test_a_configured_limit_is_the_limit_whatever_the_engine() -> None:
    budget = BudgetSettings(context_limit_tokens=1000)
    assert context_limit(budget, 2048, BODY, answer_room=False) == 1000
    assert context_limit(budget, 2048, BODY) == 1000
