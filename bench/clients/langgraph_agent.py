"""A LangGraph ReAct agent (the real ``langgraph`` and ``langchain-openai`` from PyPI), one turn per process.

The agent is what a LangChain application writes: ``create_react_agent`` on a ``ChatOpenAI`` pointed
at the server (``base_url``, ``/v1/chat/completions``), three tools, and a system prompt built on every
model call from a ``ChatPromptTemplate``: the date partial from LangChain's own how-to
(``_get_datetime``: ``%m/%d/%Y, %H:%M:%S``) and the documents a retriever found for the newest
question, joined as LangChain's RAG tutorials do (``"\\n\\n".join(doc.page_content ...)``)::

    You are an assistant for questions about a small software repository. ...
    Current date and time: {date}

    Use the following pieces of retrieved context to answer the question. ...

    Context:
    {context}

The retriever is a small keyword retriever over the repository's files (``git ls-files`` and the
untracked ones), each file one ``Document``, the best ``k`` = 2 returned as a vector store would
(always ``k``, ties by path), so what it returns changes with the question and with the edits
between turns.

Each turn is one process with the agent venv's interpreter::

    python -m bench.clients.langgraph_agent turn STATE PROMPT

``STATE`` (JSON) holds the base URL, the model and the conversation so far (``messages_to_dict``):
the turn invokes the graph with that history plus the new question and keeps the graph's messages,
as an application keeping a chat in its own store does. This module imports only the standard
library at its top: the agent venv has nothing else of the project's.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from bench.clients import agent_turn

PACKAGE = "langgraph==1.2.24 langchain-openai==1.8.1"
STATE = "langgraph-agent-state.json"
SYSTEM = (
    "You are an assistant for questions about a small software repository. Use the tools to look at "
    "files when the context below is not enough.\n"
    "Current date and time: {date}\n"
    "\n"
    "Use the following pieces of retrieved context to answer the question. If you don't know the "
    "answer, say that you don't know. Use three sentences maximum and keep the answer concise.\n"
    "\n"
    "Context:\n"
    "{context}"
)
K = 2


def _get_datetime() -> str:
    now = dt.datetime.now()
    return now.strftime("%m/%d/%Y, %H:%M:%S")


def retrieve(question: str, k: int = K) -> list[Any]:
    """The ``k`` files of the repository sharing most words with the question, as Documents."""
    from langchain_core.documents import Document

    return [
        Document(page_content=text, metadata={"source": path}) for _, path, text in agent_turn.ranked_files(question, k)
    ]


def format_docs(docs: list[Any]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def build_agent(base_url: str, model: str) -> Any:
    from langchain_core.messages import HumanMessage
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    template = ChatPromptTemplate.from_messages([("system", SYSTEM), MessagesPlaceholder("messages")]).partial(
        date=_get_datetime
    )

    def prompt(state: dict[str, Any]) -> list[Any]:
        questions = [m for m in state["messages"] if isinstance(m, HumanMessage)]
        question = questions[-1].content if questions else ""
        context = format_docs(retrieve(question if isinstance(question, str) else ""))
        return template.invoke({"messages": state["messages"], "context": context}).to_messages()

    @tool
    def read_file(path: str) -> str:
        """Read a text file of the repository."""
        return agent_turn.read_file(path)

    @tool
    def list_files() -> list[str]:
        """List the files git tracks in the repository."""
        return agent_turn.git("ls-files").split()

    @tool
    def git_log(count: int = 5) -> str:
        """The latest commits (git log --oneline)."""
        return agent_turn.git("log", "--oneline", f"-{count}")

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="sk-bench-dummy-key", temperature=0)
    return create_react_agent(llm, [read_file, list_files, git_log], prompt=prompt)


def one_turn(state_path: Path, prompt: str) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # create_react_agent's move to langchain
    from langchain_core.messages import HumanMessage, messages_from_dict, messages_to_dict

    state = json.loads(state_path.read_text())
    agent = build_agent(state["base_url"], state["model"])
    history = messages_from_dict(state["history"])
    result = agent.invoke({"messages": [*history, HumanMessage(prompt)]})
    state["history"] = messages_to_dict(result["messages"])
    state_path.write_text(json.dumps(state, indent=1))
    print(result["messages"][-1].content, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(agent_turn.main(sys.argv[1:], __doc__, one_turn))
