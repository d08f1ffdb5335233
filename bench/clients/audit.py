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

Did a unit of the client's text arrive torn? (:func:`torn_units`) For each system text the client
sent (a leading system or developer message, each text part of it; Anthropic's ``system`` blocks;
Responses' ``instructions``), the forwarded system text that keeps most of its lines in order is its
place; the client's lines missing from there moved. The units of the client's text
(``proxy.canon.units``: a label and what it introduces, a tagged element, a fence, a list, a listing)
that this set of moved lines tears (``Units.torn``: a label moved without its content or left
without any, a wrapper emptied or split, a fence or a listing split) are reported, and so are moved
lines found nowhere else in the forwarded request (lost).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from proxy.canon import units_of

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


def audit(pairs: Iterable[tuple[Any, Any | None]], *, session: bool = False) -> list[Finding]:
    """``pairs``: (backend-side Exchange, the client-side Exchange it was made for, or None).
    Returns one finding per backend request with foreign text (its first offending message):
    text its own client request did not hold, or (``session``) text no client request of the
    session up to it held (a sliding window the proxy repaired re-sends what the client sent
    before; text from nowhere is foreign either way)."""
    findings: list[Finding] = []
    sent: list[Message] = []
    for backend, client in sorted(pairs, key=lambda pair: pair[0].seq):
        messages = messages_of(backend.path, backend.json_body())
        if not messages:
            continue
        if client is None:
            findings.append(Finding(backend.seq, backend.path, None, messages[-1].role, _lines(messages[-1].text)))
            continue
        own = messages_of(client.path, client.json_body())
        if session:
            sent.extend(own)
        index = ClientText.of(sent if session else own)
        for message in messages:
            foreign = index.foreign_lines(message)
            if foreign:
                findings.append(Finding(backend.seq, backend.path, client.seq, message.role, foreign))
                break
    return findings


@dataclass
class TornFinding:
    """One client system text that arrived with units torn (or lines lost) in one backend request."""

    backend_seq: int
    path: str
    client_seq: int | None
    text_index: int  # which of the client's system texts (in order)
    moved: list[str]  # the client's lines that left their place
    torn: list[dict[str, Any]]  # each torn unit: kind, lines (first..last), its first and last line
    lost: list[str]  # moved lines found nowhere in the forwarded request

    def to_json(self) -> dict[str, Any]:
        return {
            "backend_seq": self.backend_seq,
            "path": self.path,
            "client_seq": self.client_seq,
            "text_index": self.text_index,
            "moved_lines": self.moved[:8],
            "torn_count": len(self.torn),
            "torn_units": self.torn[:5],
            "lost_count": len(self.lost),
            "lost_lines": self.lost[:5],
        }


def _parts(content: Any) -> list[str]:
    """The texts of a message's content as the proxy reads a system prompt: a string, or each text part."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def system_texts(path: str, body: Any) -> list[str]:
    """The system texts of a request: its leading system/developer messages (each text part), Anthropic's
    ``system`` (each block), Responses' ``instructions`` and leading system/developer input messages."""
    if not isinstance(body, dict):
        return []
    path = path.split("?")[0]
    out: list[str] = []
    if path.endswith("/messages"):
        return _parts(body.get("system"))
    if path.endswith("/responses"):
        if isinstance(body.get("instructions"), str):
            out.append(body["instructions"])
        items = body.get("input")
        messages = [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
    elif path.endswith("/chat/completions"):
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    else:
        return []
    for message in messages:
        if message.get("role") not in SYSTEM_ROLES or message.get("type", "message") != "message":
            break
        out.extend(_parts(message.get("content")))
    return out


def _all_lines(path: str, body: Any) -> list[str]:
    return [line for m in messages_of(path, body) for line in m.text.split("\n")] + [
        line for text in system_texts(path, body) for line in text.split("\n")
    ]


def moved_lines(sent: str, forwarded: list[str], index: int = 0) -> tuple[set[int], int]:
    """The indices of ``sent``'s non-blank lines missing from its place among the ``forwarded`` system
    texts, and the place's index (-1: none). The place is the forwarded text at ``index`` (the proxy
    keeps the client's system texts where they are and inserts what it moves after them) when it keeps
    any of ``sent``'s lines; otherwise the forwarded text that keeps most of them in order (a text
    before it was dropped)."""
    lines = sent.split("\n")
    nonblank = {i for i, line in enumerate(lines) if line.strip()}

    def kept(text: str) -> set[int]:
        matcher = SequenceMatcher(None, lines, text.split("\n"), autojunk=False)
        found: set[int] = set()
        for block in matcher.get_matching_blocks():
            found.update(range(block.a, block.a + block.size))
        return found & nonblank

    if index < len(forwarded):
        same = kept(forwarded[index])
        if same:
            return nonblank - same, index
    best: tuple[int, int, set[int]] = (0, -1, set())
    for at, text in enumerate(forwarded):
        held = kept(text)
        if len(held) > best[0]:
            best = (len(held), at, held)
    return nonblank - best[2], best[1]


# A system block vLLM ignores and the proxy drops (Claude Code's first block): not a move.
_DROPPED_PREFIXES = ("x-anthropic-billing-header:",)


def torn_units(pairs: Iterable[tuple[Any, Any | None]]) -> list[TornFinding]:
    """``pairs`` as for :func:`audit`. One finding per client system text that a backend request got
    with a unit torn or a line lost."""
    findings: list[TornFinding] = []
    for backend, client in pairs:
        if client is None or backend is client:
            continue
        sent_body, forwarded_body = client.json_body(), backend.json_body()
        sent = system_texts(client.path, sent_body)
        if not sent:
            continue
        forwarded = system_texts(backend.path, forwarded_body)
        everywhere = set(_all_lines(backend.path, forwarded_body))
        for index, text in enumerate(sent):
            if text.startswith(_DROPPED_PREFIXES):
                continue
            moving, _ = moved_lines(text, forwarded, index)
            if not moving:
                continue
            lines = text.split("\n")
            torn = [
                {
                    "kind": unit.kind,
                    "lines": [unit.first, unit.last],
                    "first": lines[unit.first][:120],
                    "last": lines[unit.last][:120],
                }
                for unit in units_of(text).torn(moving)
            ]
            lost = [lines[i] for i in sorted(moving) if lines[i] not in everywhere]
            if torn or lost:
                moved = [lines[i] for i in sorted(moving)]
                findings.append(TornFinding(backend.seq, backend.path, client.seq, index, moved, torn, lost))
    return findings
