"""A LlamaIndex chat engine with retrieved context (the real ``llama-index-core`` and
``llama-index-llms-openai-like`` from PyPI), one turn per process.

The engine is what a LlamaIndex application writes: ``ContextChatEngine.from_defaults`` on an
``OpenAILike`` pointed at the server (``api_base``, ``/v1/chat/completions``, ``is_chat_model``),
a retriever and a system prompt stamped with the date and time when the engine is built, as
LlamaIndex's chat-engine examples do (``f"... Current date and time: {datetime.now()}"``). LlamaIndex
builds the system message itself: our system prompt, then its ``DEFAULT_CONTEXT_TEMPLATE`` with the
retrieved nodes (``Use the context information below to assist the user.`` between dashed rules, each
node as ``file_path: ...`` metadata then its text), then the chat history and the question.

The retriever is a small keyword ``BaseRetriever`` over the repository's files (``git ls-files`` and the
untracked ones), each file one ``TextNode``, the best ``k`` = 2 returned as a vector index would (always
``k``, ties by path), so what it returns changes with the question and with the edits between turns.

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.llamaindex_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the chat history (``ChatMessage.model_dump()``),
handed back to ``chat(..., chat_history=...)`` as an application keeping the chat in its own store
does. This module imports only the standard library at its top: the agent venv has nothing else of
the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "llama-index-core==0.14.25 llama-index-llms-openai-like==0.8.1"
STATE = "llamaindex-agent-state.json"
K = 2


def system_prompt() -> str:
    now = dt.datetime.now().replace(microsecond=0)
    return (
        "You are a helpful assistant for questions about a small software repository. "
        "Answer from the context; if it is not there, say that you don't know.\n"
        f"Current date and time: {now.strftime('%Y-%m-%d %H:%M:%S')}"
    )


def build_engine(base_url: str, model: str) -> Any:
    from llama_index.core import Settings
    from llama_index.core.chat_engine import ContextChatEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.openai_like import OpenAILike

    # No tiktoken download here (no network): LlamaIndex counts tokens with this for its memory and
    # for how much context fits, as an application with its own tokenizer sets it.
    Settings.tokenizer = lambda text: text.split()

    class RepoRetriever(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [
                NodeWithScore(node=TextNode(text=text, metadata={"file_path": path}), score=float(score))
                for score, path, text in agent_turn.ranked_files(query_bundle.query_str, K)
            ]

    llm = OpenAILike(
        model=model,
        api_base=base_url,
        api_key="sk-bench-dummy-key",
        is_chat_model=True,
        context_window=32768,
        temperature=0,
    )
    return ContextChatEngine.from_defaults(retriever=RepoRetriever(), llm=llm, system_prompt=system_prompt())


def one_turn(state_path: Path, prompt: str) -> int:
    from llama_index.core.llms import ChatMessage

    state = json.loads(state_path.read_text())
    engine = build_engine(state["base_url"], state["model"])
    history = [ChatMessage.model_validate(m) for m in state["history"]]
    response = engine.chat(prompt, chat_history=history)
    state["history"] = [m.model_dump(mode="json") for m in engine.chat_history]
    state_path.write_text(json.dumps(state, indent=1))
    print(response.response, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
