"""Open WebUI (``open-webui`` 0.12.4) driven over its HTTP and socket.io API the way its web front end is.

The server is started once per run (``serve``): a fresh ``DATA_DIR`` under the run's ``HOME``,
``OPENAI_API_BASE_URL`` pointing at the proxy or the backend recorder, ``ENABLE_FORWARD_USER_INFO_HEADERS``
on (so it sends ``X-OpenWebUI-Chat-Id``), title, tags and follow-up generation left on (their defaults).
Then, as the front end does: sign in (``WEBUI_AUTH=False``: ``POST /api/v1/auths/signin``), create a
workspace model on the served model with a system prompt holding ``{{CURRENT_DATE}}``,
``{{CURRENT_TIME}}`` and ``{{USER_NAME}}`` (``POST /api/v1/models/create``, ModelEditor's defaults).

Each bench turn is one process (``python -m bench.clients.openwebui turn STATE INDEX PROMPT`` with the
venv's interpreter: it has ``python-socketio``) that sends one message in each of ``CHATS`` chats,
following ``src/lib/components/chat/Chat.svelte`` (``submitPrompt`` -> ``sendMessage`` ->
``sendMessageSocket``, read from the source maps shipped in the wheel):

- a socket.io connection on ``/ws/socket.io`` (``auth: {token}``, then ``user-join``); its sid is the
  request's ``session_id``, so the server runs the chat as a task and reports over the socket;
- the user message ``{id, parentId: history.currentId, childrenIds: [assistant id], role, user,
  user_id, content, timestamp, models}`` and an empty assistant message in the local history;
- ``POST /api/chat/completions`` with ``stream``, ``model``, ``params``, ``tool_ids``,
  ``tool_servers``, ``features``, ``variables`` (``getPromptVariables``: the date and time at the
  request), ``model_item``, ``session_id``, ``chat_id`` (absent for a new chat: 0.12 creates the chat
  itself from ``parent_id: null`` and answers its id), ``id``, ``message_ids``, ``parent_id``,
  ``user_message``, ``background_tasks`` (title and tags on a chat's first message, follow-ups always).
  No ``messages``: for a saved chat the front end sends only a chat-level system prompt (none here)
  and the server rebuilds the conversation from its database;
- wait for the ``chat:completion`` event with ``done`` for the assistant message, then ``chat:active``
  false for the chat (its background tasks ran in the same task), and on a new chat the separate
  ``chat:title`` task; then ``GET /api/v1/chats/{id}`` (the answer must be saved, content and done)
  and ``GET /api/v1/chats/?page=1`` (``chatCompletedHandler``: 0.12's front end saves nothing itself
  after a reply, the backend persists it inline).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.clients import install

PACKAGE = "open-webui==0.12.4"
CHATS = int(os.environ.get("BENCH_OPENWEBUI_CHATS", "4"))
MODEL_ID = "bench-assistant"
STATE = "open-webui-state.json"
TOPICS = ("a tiny calculator", "a weekend trip", "a reading list", "a team meeting", "a garden", "a new laptop")
SYSTEM_PROMPT = (
    "You are Bench Assistant, a concise helper for a small team.\n"
    "Answer in one or two sentences and say so when you are unsure.\n"
    "Today's date is {{CURRENT_DATE}} and the local time is {{CURRENT_TIME}}.\n"
    "You are talking with {{USER_NAME}}; address them by name only when greeting.\n"
    "Prefer plain language and use lists only when asked.\n"
    "Never invent facts about the user's files or projects."
)
# ModelEditor's DEFAULT_CAPABILITIES (src/lib/constants.ts); `usage: undefined` is left out.
CAPABILITIES = {
    "file_context": True, "vision": True, "file_upload": True, "web_search": True, "image_generation": True,
    "code_interpreter": True, "terminal": True, "citations": True, "status_updates": True, "memory": True,
    "builtin_tools": True,
}  # fmt: skip
REPO_ROOT = Path(__file__).resolve().parents[2]


def install_open_webui() -> Path:
    """``open-webui`` into ``.work/venv-open-webui`` (Python 3.11: its pins do not build on 3.12+ here)."""
    python = install.find_python(("3.11",))
    binary = install.pip_package("open-webui", PACKAGE, "open-webui", python=python, timeout=2400.0)
    # `open-webui` has no --version (the bench prints each client's): a wrapper that answers it.
    wrapper = binary.with_name("open-webui-bench")
    if not wrapper.exists():
        wrapper.write_text(
            "#!/bin/sh\n"
            'here="$(dirname "$0")"\n'
            'if [ "$1" = "--version" ]; then\n'
            '  exec "$here/python" -c "import importlib.metadata as m; '
            "print('open-webui', m.version('open-webui'))\"\n"
            "fi\n"
            'exec "$here/open-webui" "$@"\n'
        )
        wrapper.chmod(0o755)
    return wrapper


def environment(home: Path, openai_base: str, port: int) -> dict[str, str]:
    """The server's environment (on top of the bench's client environment)."""
    return {
        "DATA_DIR": str(home / "open-webui-data"),
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": "bench-open-webui-secret",
        "OFFLINE_MODE": "True",
        "HF_HUB_OFFLINE": "1",
        "ENABLE_OLLAMA_API": "False",
        "ENABLE_OPENAI_API": "True",
        "OPENAI_API_BASE_URL": openai_base,
        "OPENAI_API_KEY": "sk-bench-dummy-key",
        "ENABLE_FORWARD_USER_INFO_HEADERS": "true",
        "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "OPENWEBUI_BENCH_PORT": str(port),
        "PYTHONPATH": str(REPO_ROOT),  # the turn driver: python -m bench.clients.openwebui
    }


@contextlib.contextmanager
def serve(
    binary: Path, home: Path, model: str, env: dict[str, str], log: Path, timeout: float = 900.0
) -> Iterator[str]:
    """``open-webui serve`` until the context exits, signed in and with the workspace model; yields its URL.

    Writes the turn driver's state file (``home/STATE``)."""
    port = int(env["OPENWEBUI_BENCH_PORT"])
    url = f"http://127.0.0.1:{port}"
    Path(env["DATA_DIR"]).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(binary), "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=str(home),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_health(url, proc, timeout)
        with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as http:
            signin = http.post("/api/v1/auths/signin", json={"email": "", "password": ""})
            signin.raise_for_status()
            user = signin.json()
            auth = {"Authorization": f"Bearer {user['token']}"}
            models = http.get("/api/models", headers=auth).json()["data"]
            if not any(m["id"] == model for m in models):
                raise RuntimeError(f"open-webui does not list {model}: {[m['id'] for m in models]}")
            created = http.post(
                "/api/v1/models/create",
                headers=auth,
                json={
                    "id": MODEL_ID,
                    "base_model_id": model,
                    "name": "Bench Assistant",
                    "meta": {
                        "profile_image_url": "/static/favicon.png",
                        "description": "The bench's workspace model",
                        "suggestion_prompts": None,
                        "tags": [],
                        "capabilities": CAPABILITIES,
                    },
                    "params": {"system": SYSTEM_PROMPT},
                    "access_grants": [],
                    "is_active": True,
                },
            )
            created.raise_for_status()
        state = {"url": url, "token": user["token"], "user": {"id": user["id"], "name": user["name"]}, "chats": []}
        (home / STATE).write_text(json.dumps(state, indent=1))
        with log.open("a") as out:
            out.write(f"\n[bench] open-webui ready after {time.monotonic() - started:.0f} s\n")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"open-webui serve exited with {proc.returncode} before answering /health")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        time.sleep(2.0)
    raise TimeoutError(f"open-webui did not answer {url}/health within {timeout:.0f} s")


# --- the turn driver (runs with the open-webui venv's interpreter) ---------------------------------


def prompt_variables(user_name: str) -> dict[str, str]:
    """``getPromptVariables`` of src/lib/utils/index.ts, in the browser's local time."""
    now = dt.datetime.now().astimezone()
    date, clock = now.strftime("%Y-%m-%d"), now.strftime("%H:%M:%S")
    return {
        "{{USER_NAME}}": user_name,
        "{{USER_EMAIL}}": "admin@localhost",
        "{{USER_LOCATION}}": "Unknown",
        "{{CURRENT_DATETIME}}": f"{date} {clock}",
        "{{CURRENT_DATE}}": date,
        "{{CURRENT_TIME}}": clock,
        "{{CURRENT_WEEKDAY}}": now.strftime("%A"),
        "{{CURRENT_TIMEZONE}}": os.environ.get("TZ") or "UTC",
        "{{USER_LANGUAGE}}": "en-US",
    }


def messages_list(history: dict[str, Any], message_id: str | None) -> list[dict[str, Any]]:
    """``createMessagesList``: the branch ending at ``message_id``, root first."""
    out = []
    while message_id is not None and message_id in history["messages"]:
        message = history["messages"][message_id]
        out.append(message)
        message_id = message.get("parentId")
    return out[::-1]


class Events:
    """What the socket delivered: every ``events`` payload, in order."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    def add(self, payload: dict[str, Any]) -> None:
        self.items.append(payload)
        self.changed.set()

    async def wait(self, predicate: Any, timeout: float, start: int = 0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if any(predicate(e) for e in self.items[start:]):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))


def _kind(event: dict[str, Any]) -> str:
    return str((event.get("data") or {}).get("type") or "")


async def one_turn(state_path: Path, index: int, prompt: str, timeout: float) -> int:
    import socketio  # the open-webui venv has it (python-socketio, aiohttp)

    state = json.loads(state_path.read_text())
    url, token, user = state["url"], state["token"], state["user"]
    auth = {"Authorization": f"Bearer {token}"}
    failures = 0
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=300.0, trust_env=False) as http:
        config = (await http.get("/api/config")).json()
        models = (await http.get("/api/models")).json()["data"]
        model_item = next(m for m in models if m["id"] == MODEL_ID)
        events = Events()
        sio = socketio.AsyncClient(reconnection=False)

        @sio.on("events")
        async def _on_events(payload: dict[str, Any]) -> None:
            events.add(payload)

        await sio.connect(url, socketio_path="/ws/socket.io", transports=["websocket"], auth={"token": token})
        await sio.emit("user-join", {"auth": {"token": token}})
        sid = sio.get_sid()
        try:
            while len(state["chats"]) < CHATS:
                state["chats"].append({"id": None, "history": {"messages": {}, "currentId": None}})
            for number, chat in enumerate(state["chats"]):
                text = f"{prompt} (This chat is about {TOPICS[number % len(TOPICS)]}.)"
                # One person sends these messages: no two in one clock second (a person reads the
                # answer and types; in practice far slower). A faster bench gives the direct run hits
                # no real traffic gets: {{CURRENT_TIME}} has one-second resolution, and two messages
                # in one second share the system prompt with it and the tools after it.
                while int(time.time()) <= state.get("last_second", 0):
                    await asyncio.sleep(0.05)
                state["last_second"] = int(time.time())
                ok = await _send(http, sio, sid, events, config, model_item, user, chat, text, timeout)
                failures += 0 if ok else 1
                print(
                    f"chat {number + 1} turn {index + 1}: {'ok' if ok else 'FAILED'} chat_id={chat['id']}", flush=True
                )
        finally:
            await sio.disconnect()
    state_path.write_text(json.dumps(state, indent=1))
    return 1 if failures else 0


async def _send(
    http: httpx.AsyncClient, sio: Any, sid: str, events: Events, config: dict[str, Any],
    model_item: dict[str, Any], user: dict[str, Any], chat: dict[str, Any], text: str, timeout: float,
) -> bool:  # fmt: skip
    history = chat["history"]
    chat_id = chat["id"]
    now = int(time.time())
    # submitPrompt
    user_id, assistant_id = str(uuid.uuid4()), str(uuid.uuid4())
    parent = history["currentId"]
    history["messages"][user_id] = {
        "id": user_id, "parentId": parent, "childrenIds": [], "role": "user",
        "user": {"id": user["id"], "name": user["name"]}, "user_id": user["id"], "content": text,
        "timestamp": now, "models": [MODEL_ID],
    }  # fmt: skip
    if parent is not None:
        history["messages"][parent]["childrenIds"].append(user_id)
    # sendMessage: the empty reply, linked to its parent
    history["messages"][assistant_id] = {
        "parentId": user_id, "id": assistant_id, "childrenIds": [], "role": "assistant", "user_id": user["id"],
        "content": "", "done": False, "model": MODEL_ID, "modelName": model_item.get("name", MODEL_ID),
        "modelIdx": 0, "timestamp": now,
    }  # fmt: skip
    history["messages"][user_id]["childrenIds"].append(assistant_id)
    history["currentId"] = assistant_id
    user_message = json.loads(json.dumps(history["messages"][user_id]))
    first = not chat_id or (parent is None and len(messages_list(history, assistant_id)) == 2)
    features = config.get("features") or {}
    body: dict[str, Any] = {
        "stream": True,
        "model": MODEL_ID,
        "params": {"model_controls": {}},
        "tool_ids": [],
        "tool_servers": [],
        "features": {
            "voice": False,
            "image_generation": False,
            "code_interpreter": False,
            "web_search": False,
            **({"memory": True} if features.get("enable_memories") else {}),
        },
        "variables": prompt_variables(user["name"]),
        **({} if chat_id else {"chat_variables": {}}),
        "model_item": model_item,
        "session_id": sid,
        **({"chat_id": chat_id} if chat_id else {}),
        "id": assistant_id,
        "message_ids": [{"model_id": MODEL_ID, "message_id": assistant_id, "modelIdx": 0}],
        "parent_id": parent,
        "user_message": user_message,
        "background_tasks": {
            **({"title_generation": True, "tags_generation": True} if first else {}),
            "follow_up_generation": True,
        },
    }
    seen = len(events.items)
    answer = await http.post("/api/chat/completions", json=body)
    if answer.status_code != 200:
        print(f"POST /api/chat/completions -> {answer.status_code} {answer.text[:300]}", flush=True)
        return False
    result = answer.json()
    if not chat_id:
        chat_id = chat["id"] = result["chat_id"]
        with contextlib.suppress(Exception):
            await sio.emit("events:chat", {"chat_id": chat_id, "data": {"type": "join"}})

    def mine(e: dict[str, Any]) -> bool:
        return e.get("chat_id") == chat_id and not e.get("shared")

    def completed(e: dict[str, Any]) -> bool:
        data = (e.get("data") or {}).get("data") or {}
        return (
            mine(e) and e.get("message_id") == assistant_id and _kind(e) == "chat:completion" and bool(data.get("done"))
        )

    def idle(e: dict[str, Any]) -> bool:
        data = (e.get("data") or {}).get("data") or {}
        return mine(e) and _kind(e) == "chat:active" and data.get("active") is False

    done = await events.wait(completed, timeout, seen)
    settled = await events.wait(idle, timeout, seen)
    if first:  # the new chat's title runs as its own task
        await events.wait(lambda e: mine(e) and _kind(e) == "chat:title", 60.0, seen)
    saved = (await http.get(f"/api/v1/chats/{chat_id}")).json()
    server_history = (saved.get("chat") or {}).get("history") or {}
    reply = (server_history.get("messages") or {}).get(assistant_id) or {}
    if server_history.get("messages"):
        chat["history"] = {"messages": server_history["messages"], "currentId": assistant_id}
    await http.get("/api/v1/chats/", params={"page": 1})  # refreshChatList
    ok = done and settled and bool(reply.get("content")) and bool(reply.get("done"))
    if not ok:
        print(f"  done={done} idle={settled} saved={json.dumps(reply)[:300]}", flush=True)
    return ok


def main(argv: list[str]) -> int:
    """``python -m bench.clients.openwebui turn STATE INDEX PROMPT``: one bench turn."""
    if len(argv) != 4 or argv[0] != "turn":
        print(main.__doc__, file=sys.stderr)
        return 2
    timeout = float(os.environ.get("BENCH_OPENWEBUI_REPLY_TIMEOUT", "120"))
    return asyncio.run(one_turn(Path(argv[1]), int(argv[2]), argv[3], timeout))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
