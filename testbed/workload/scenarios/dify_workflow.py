"""``dify_workflow``: a Dify workflow LLM node with retrieved chunks between two instruction blocks.

A workflow's prompt is written by the app's author: an instruction, then the knowledge
retrieval node's output (``{{#context#}}``, the chunks joined as Dify joins them), then the
rules for answering::

    {the instruction's opening paragraph: the role}

    Here is the retrieved context:
    {chunk}

    {chunk}
    ...

    {the rest of the instruction, then the answering rules}

The chunks differ on every run: documents (paragraphs of the bundled texts) and code
(fenced, ```` ```python ```` ... ```` ``` ````), so the retrieved region is full of lines that
also occur elsewhere in the prompt or in other requests (fences, blank lines, ``import``
lines). The instructions are real Dify prompts: the Python Coding Prompt and the English
Twitter-thread writer of the bundled data, above the answering rules of Dify's own
document-chat node. Dify runs a workflow once per submission (one system prompt, one user
message): half the sessions are such repeated runs; the other half are a chatflow
(advanced-chat) with the history replayed.

Direct, everything after the first chunk misses on every run. The proxy must move the
retrieved region *whole* (fences, blank lines and the line introducing it included) for
the answering rules to stay in the cached prefix.
"""

from __future__ import annotations

import random
import zlib

from testbed.workload.corpus import dify_node
from testbed.workload.registry import Scenario
from testbed.workload.scenarios.common import mt_bench_turns, user_turn_count
from testbed.workload.scenarios.dify_rag import APPS as RAG_APPS
from testbed.workload.scenarios.dify_rag import RagApp, retrieve
from testbed.workload.session import Message, Session

NAME = "dify_workflow"
DOCUMENTS = 2  # document chunks per run
CODE_CHUNKS = 2  # code chunks per run
RULES_NODE = ("document chat", "1720801890321")  # its answering rules follow </context>

# Written for this workload: code a repository's retriever returns (paths and bodies).
CODE = (
    (
        "app/config.py",
        "import os\nfrom dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass Settings:\n"
        '    database_url: str = os.environ.get("DATABASE_URL", "sqlite:///app.db")\n'
        '    debug: bool = os.environ.get("DEBUG") == "1"',
    ),
    (
        "app/routes/users.py",
        "from fastapi import APIRouter, HTTPException\n\nrouter = APIRouter()\n\n\n"
        '@router.get("/users/{user_id}")\nasync def get_user(user_id: int) -> dict:\n'
        "    user = await repository.find(user_id)\n    if user is None:\n"
        '        raise HTTPException(status_code=404, detail="user not found")\n    return user.as_dict()',
    ),
    (
        "app/cache.py",
        "import functools\nimport time\n\n\ndef ttl_cache(seconds: float):\n    def decorate(function):\n"
        "        cached = {}\n\n        @functools.wraps(function)\n        def wrapper(*args):\n"
        "            now = time.monotonic()\n            if args in cached and now - cached[args][0] < seconds:\n"
        "                return cached[args][1]\n            value = function(*args)\n"
        "            cached[args] = (now, value)\n            return value\n\n        return wrapper\n\n"
        "    return decorate",
    ),
    (
        "tests/test_orders.py",
        "import pytest\n\nfrom app.orders import Order, total\n\n\n"
        '@pytest.mark.parametrize("quantity, expected", [(1, 10), (3, 30), (0, 0)])\n'
        "def test_total(quantity: int, expected: int) -> None:\n"
        '    assert total([Order("book", 10, quantity)]) == expected',
    ),
    (
        "app/orders.py",
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Order:\n    item: str\n    price: int\n"
        "    quantity: int\n\n\ndef total(orders: list[Order]) -> int:\n"
        "    return sum(order.price * order.quantity for order in orders)",
    ),
    (
        "scripts/export.py",
        "import csv\nimport sys\n\nimport pandas as pd\n\n\ndef main(path: str) -> None:\n"
        '    frame = pd.read_sql_table("orders", "sqlite:///app.db")\n'
        "    frame.to_csv(path, index=False, quoting=csv.QUOTE_MINIMAL)\n\n\n"
        'if __name__ == "__main__":\n    main(sys.argv[1])',
    ),
    (
        "app/auth.py",
        "import hashlib\nimport hmac\nimport os\n\n\n"
        "def hash_password(password: str, salt: bytes | None = None) -> str:\n"
        "    salt = salt or os.urandom(16)\n"
        '    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, 600_000)\n'
        "    return salt.hex() + digest.hex()\n\n\ndef check_password(password: str, stored: str) -> bool:\n"
        "    salt = bytes.fromhex(stored[:32])\n    return hmac.compare_digest(hash_password(password, salt), stored)",
    ),
    (
        "app/worker.py",
        "import asyncio\nimport logging\n\nlog = logging.getLogger(__name__)\n\n\n"
        "async def run(queue: asyncio.Queue) -> None:\n    while True:\n        job = await queue.get()\n"
        "        try:\n            await job()\n        except Exception:\n"
        '            log.exception("job failed")\n        finally:\n            queue.task_done()',
    ),
)


# A workflow's LLM nodes: a coding prompt, and the Twitter writer of the RAG apps (same fills).
APPS = (RagApp("Python Coding Prompt", "llm"), RAG_APPS[1])


def answering_rules() -> str:
    """The rules Dify's document-chat node puts after its context (real text)."""
    return dify_node(*RULES_NODE).system.split("</context>\n", 1)[1].strip()


def code_chunks(query: str, count: int = CODE_CHUNKS) -> list[str]:
    """``count`` fenced code chunks for ``query`` (a pure function of it)."""
    ranked = sorted(CODE, key=lambda item: zlib.crc32(f"{query}\x00{item[0]}".encode()))
    return [f"```python\n# {path}\n{body}\n```" for path, body in ranked[:count]]


def retrieved_context(query: str) -> str:
    """Documents and code for ``query``, interleaved, joined by blank lines."""
    documents = retrieve(query, DOCUMENTS)
    code = code_chunks(query)
    chunks = [chunk for pair in zip(documents, code, strict=False) for chunk in pair]
    chunks += documents[len(code) :] + code[len(documents) :]
    return "\n\n".join(chunks)


class DifyWorkflowSession(Session):
    def __init__(self, index: int, rng: random.Random) -> None:
        super().__init__(NAME, index, rng, mt_bench_turns(rng, user_turn_count(rng), index // len(APPS)))
        self.app = APPS[index % len(APPS)]
        # Even sessions: repeated runs of a workflow (each run is one system prompt and one message);
        # odd ones: a chatflow that replays its history.
        self.single_turn = (index // len(APPS)) % 2 == 0
        # The instruction's opening paragraph (the role) above the context, the rest below it.
        self._role, _, rest = self.app.instruction.partition("\n\n")
        self._rules = f"{rest}\n\n{answering_rules()}" if rest else answering_rules()

    def system_messages(self, query: str) -> list[Message]:
        context = retrieved_context(query)
        prompt = f"{self._role}\n\nHere is the retrieved context:\n{context}\n\n{self._rules}"
        return [{"role": "system", "content": prompt}]

    def render_history(self) -> list[Message]:
        history = super().render_history()
        if self.single_turn:
            return history[-1:]
        return history


SCENARIO = Scenario(
    NAME,
    "Dify workflow: retrieved documents and fenced code between two instruction blocks",
    DifyWorkflowSession,
    default=False,
)
