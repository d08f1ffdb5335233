"""Did the backend get text the client did not send?

Each request the backend received is matched to the client's request it was made for (the proxy sends
the ``x-request-id`` it answers the client with upstream too; directly, the two are one request). Every
message the backend got must be the client's own text: a message equal to one the client sent, or one
whose every non-blank line is a line the client sent in that request, in a message of the same role
or in its system prompt (the proxy's ``relocate`` moves whole volatile lines of the system prompt, so
a message it inserts may hold only system-prompt lines). Anything else (a summary the proxy wrote, an
instruction it added, a request it made on its own) counts as text the client did not send.

Text is read per protocol: chat completions (``messages``), Anthropic Messages (``system`` and
``messages``, text blocks and ``tool_result`` content) and Responses (``instructions`` and ``input``
messages, ``function_call_output``). Tool calls' arguments and tool definitions are not messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SYSTEM_ROLES = ("system", "developer")


@dataclass
class Message:
    role: str
    text: str


@dataclass
class Finding:
    """One backend request with text its client did not send."""

    backend_seq: int
    path: str
    client_seq: int | None
    role: str
    lines: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "backend_seq": self.backend_seq,
            "path": self.path,
            "client_seq": self.client_seq,
            "role": self.role,
            "foreign_lines": self.lines[:5],
        }


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or its text-bearing parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                kind = part.get("type")
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif kind == "tool_result":
                    parts.append(_text_of(part.get("content")))
        return "\n".join(p for p in parts if p)
    return ""


def messages_of(path: str, body: Any) -> list[Message]:
    """The messages of a request body, per protocol (empty for other routes)."""
    if not isinstance(body, dict):
        return []
    path = path.split("?")[0]
    out: list[Message] = []
    if path.endswith("/messages") or path.endswith("/messages/count_tokens"):
        system = _text_of(body.get("system"))
        if system:
            out.append(Message("system", system))
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                content = message.get("content")
                role = str(message.get("role"))
                if isinstance(content, list):
                    # tool results are their own (tool) messages once converted to chat
                    results = [p for p in content if isinstance(p, dict) and p.get("type") == "tool_result"]
                    for result in results:
                        out.append(Message("tool", _text_of(result.get("content"))))
                    rest = [p for p in content if not (isinstance(p, dict) and p.get("type") == "tool_result")]
                    text = _text_of(rest)
                    if text or not results:
                        out.append(Message(role, text))
                else:
                    out.append(Message(role, _text_of(content)))
    elif path.endswith("/responses"):
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            out.append(Message("system", body["instructions"]))
        items = body.get("input")
        if isinstance(items, str):
            out.append(Message("user", items))
        elif isinstance(items, list):
            for item in items:
                if not isinstance(item, dict):
                    continue
                kind = item.get("type", "message")
                if kind == "message":
                    out.append(Message(str(item.get("role")), _text_of(item.get("content"))))
                elif kind == "function_call_output":
                    output = item.get("output")
                    out.append(Message("tool", output if isinstance(output, str) else _text_of(output)))
    elif path.endswith("/chat/completions"):
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                out.append(Message(str(message.get("role")), _text_of(message.get("content"))))
    elif path.endswith("/completions") and isinstance(body.get("prompt"), str):
        out.append(Message("user", body["prompt"]))
    return out


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def _canonical_role(role: str) -> str:
    return "system" if role in SYSTEM_ROLES else role


@dataclass
class ClientText:
    """What one client request held, indexed for the check."""

    texts: set[str] = field(default_factory=set)
    lines_by_role: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, messages: Iterable[Message]) -> ClientText:
        index = cls()
        for message in messages:
            role = _canonical_role(message.role)
            index.texts.add(message.text.strip())
            index.lines_by_role.setdefault(role, set()).update(_lines(message.text))
        return index

    def foreign_lines(self, message: Message) -> list[str]:
        """The lines of ``message`` the client did not send where they may come from."""
        if message.text.strip() in self.texts:
            return []
        role = _canonical_role(message.role)
        allowed = self.lines_by_role.get(role, set()) | self.lines_by_role.get("system", set())
        return [line for line in _lines(message.text) if line not in allowed]


def audit(pairs: Iterable[tuple[Any, Any | None]]) -> list[Finding]:
    """``pairs``: (backend-side Exchange, the client-side Exchange it was made for, or None).
    Returns one finding per backend request with foreign text (its first offending message)."""
    findings: list[Finding] = []
    for backend, client in pairs:
        messages = messages_of(backend.path, backend.json_body())
        if not messages:
            continue
        if client is None:
            findings.append(Finding(backend.seq, backend.path, None, messages[-1].role, _lines(messages[-1].text)))
            continue
        index = ClientText.of(messages_of(client.path, client.json_body()))
        for message in messages:
            foreign = index.foreign_lines(message)
            if foreign:
                findings.append(Finding(backend.seq, backend.path, client.seq, message.role, foreign))
                break
    return findings
