"""Dify through its OpenAI-compatible model plugin: the real ``dify_plugin`` SDK from PyPI sends what a
Dify chatbot with a knowledge base sends.

In Dify the API server builds the prompt and a model plugin sends it: for a self-hosted vLLM that is
the OpenAI-API-compatible provider, whose LLM is the SDK's own ``OAICompatLargeLanguageModel``
(``dify_plugin/interfaces/model/openai_compatible/llm.py``; the official plugin subclasses it). The
bench plays the API server's part: a basic chatbot's simple prompt transform (Dify's context prompt,
the retrieved chunks for this query inside ``<context>``, then the app's instruction: the
``dify_rag`` app of the workload, two real Dify prompts), the conversation's history as Dify keeps
it, and the query; the plugin's ``invoke`` does the HTTP (``requests``, streamed, as in Dify).

Each turn is one process with the plugin venv's interpreter::

    python -m bench.clients.dify turn STATE INDEX

``STATE`` (JSON, written by the bench before the turn) holds the endpoint, the model, the system
prompt and query of this turn and the history so far; the turn appends the query and the answer.
This module imports only the standard library at its top: the plugin venv has nothing else of
the project's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PACKAGE = "dify_plugin==0.7.4"
STATE = "dify-state.json"
# Conversations of one run (the workload's two apps, alternately).
CONVERSATIONS = 2


def write_turn(state_path: Path, base_url: str, model: str, index: int, prompt: str) -> None:
    """Before turn ``index``: each conversation's system prompt for its query (retrieval on it)."""
    from testbed.workload.corpus import dify_node, fill_placeholders
    from testbed.workload.scenarios.dify_rag import APPS, CONTEXT_NODE, retrieve

    state = json.loads(state_path.read_text()) if state_path.exists() else {"conversations": []}
    state.update({"endpoint_url": base_url + "/v1", "model": model})
    conversations = state["conversations"]
    while len(conversations) < CONVERSATIONS:
        conversations.append({"history": []})
    context_prompt = dify_node(*CONTEXT_NODE).system
    for number, conversation in enumerate(conversations):
        query = f"{prompt} (conversation {number + 1})"
        context = "\n".join(retrieve(query))
        instruction = APPS[number % len(APPS)].instruction
        conversation["system"] = f"{fill_placeholders(context_prompt, {'context': context})}\n\n{instruction}"
        conversation["query"] = query
    state_path.write_text(json.dumps(state, ensure_ascii=False, indent=1))


def one_turn(state_path: Path) -> int:
    """Send each conversation's turn through the plugin (in the plugin's venv)."""
    from dify_plugin.entities.model.message import AssistantPromptMessage, SystemPromptMessage, UserPromptMessage
    from dify_plugin.interfaces.model.ai_model import AIModel
    from dify_plugin.interfaces.model.openai_compatible.llm import OAICompatLargeLanguageModel

    # The SDK estimates usage with tiktoken's gpt2 encoding, which tiktoken downloads on first use
    # (openaipublic.blob.core.windows.net): unreachable here. Offline, a length estimate stands in.
    # It feeds only the plugin's own usage figures, never what is sent.
    AIModel._get_num_tokens_by_gpt2 = lambda self, text: max(1, len(text) // 4)  # type: ignore[method-assign]

    state = json.loads(state_path.read_text())
    credentials = {
        "endpoint_url": state["endpoint_url"],
        "api_key": "sk-bench-dummy-key",
        "mode": "chat",
        "context_size": "32768",
        "max_tokens_to_sample": "512",
        "stream_mode_delimiter": "\n\n",
    }
    llm = OAICompatLargeLanguageModel([])
    failures = 0
    for number, conversation in enumerate(state["conversations"]):
        messages: list[Any] = [SystemPromptMessage(content=conversation["system"])]
        for turn in conversation["history"]:
            messages.append(UserPromptMessage(content=turn["query"]))
            messages.append(AssistantPromptMessage(content=turn["answer"]))
        messages.append(UserPromptMessage(content=conversation["query"]))
        try:
            chunks = llm.invoke(
                state["model"],
                credentials,
                messages,
                {"temperature": 0.7, "max_tokens": 256},
                stream=True,
                user=f"bench-user-{number}",
            )
            answer = "".join(str(chunk.delta.message.content or "") for chunk in chunks)
        except Exception as error:  # the plugin's InvokeError family: a failed turn, reported
            print(f"conversation {number + 1}: FAILED {type(error).__name__}: {error}", flush=True)
            failures += 1
            continue
        conversation["history"].append({"query": conversation["query"], "answer": answer})
        print(f"conversation {number + 1}: ok ({len(answer)} chars)", flush=True)
    state_path.write_text(json.dumps(state, ensure_ascii=False, indent=1))
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "turn":
        print(__doc__, file=sys.stderr)
        return 2
    return one_turn(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
