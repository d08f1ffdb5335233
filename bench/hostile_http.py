"""A generator of hostile HTTP for the proxy: every route and method, wrong types everywhere, deep
nesting, huge strings and headers, lone surrogates, invalid UTF-8, NaN.

Requests are raw bytes sent over a plain socket (``send``), so nothing on the client side tidies
them up. Deterministic for a seed. Used by tests/test_fuzz.py (a bounded run in CI) and by
``python -m bench.fuzz`` (as many requests as you like).
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import random
import socket
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from proxy.http import InvalidPath, canonical_path

# Every route the proxy serves, and a few it does not.
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/sessions",
    "/v1/sessions/abc",
    "/admin/tenants/acme/sessions",
    "/admin/tenants/acme/sessions/abc",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/responses",
    "/v1/responses/resp_abc",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/reset_prefix_cache",
    "/v1/audio/transcriptions",
    "/",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
WEIRD_PATH_PARTS = ["%ff%fe", "%00", "..%2f..%2f", "%ed%a0%80", "a" * 3000, "%F0%9F%98%80", "x%20y", "%25"]
# What a router on the way may read as another path (or none): control characters, whitespace, path
# parameters, what decodes into a query or fragment, look-alike slashes (proxy.http.paths).
PATH_TAILS = [
    "%0A",
    "%0D%0A",
    "%0D",
    "%09",
    "%00",
    "%20",
    "%0B",
    "%7F",
    ";",
    ";x=1",
    "%3B",
    "%3F",
    "%23",
    "%E2%88%95x",
    "%EF%BC%8Fx",
    "%C2%A0",
    "%E2%80%8B",
    "%252F",
    ".",
]
# Routes that generate, the proxy's and those a tenant may not reach past its pipeline.
GENERATION_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/responses/compact",
    "/invocations",
    "/v1/chat/completions/batch",
    "/inference/v1/generate",
    "/generative_scoring",
    "/cohere/v2/chat",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/collective_rpc",
    "/v1/load_lora_adapter",
]
# Upstream behaviours that are no answer (bench.hostile_upstream): a request naming one as its model
# gets the upstream's failure, which the proxy may only answer as the upstream's (502, 504).
UPSTREAM_FAILURES = ["not-json", "cut", "cut-mid", "drop", "html-error", "malformed-chunk", "json-for-stream"]
LIMITS = ["abc", "0", "-1", "1.5", "", "%ff", "1e3", "99999999999999999999", "10", "%00", "1000000"]

CHAT_TEMPLATE: dict[str, Any] = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are helpful. Today is 2024-05-01."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "thanks", "name": "bob"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "w",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "tool_choice": "auto",
    "max_tokens": 5,
    "stream": False,
    "stream_options": {"include_usage": True},
    "response_format": {"type": "text"},
    "prompt_cache_key": "pk",
    "user": "u",
    "cache_salt": "s",
}
COMPLETION_TEMPLATE: dict[str, Any] = {"model": "fake-model", "prompt": "hello", "max_tokens": 3, "stream": False}
EMBEDDING_TEMPLATE: dict[str, Any] = {"model": "fake-model", "input": ["a", "b"]}
MESSAGES_TEMPLATE: dict[str, Any] = {
    "model": "fake-model",
    "max_tokens": 5,
    "system": [
        {"type": "text", "text": "You are helpful. Today is 2024-05-01.", "cache_control": {"type": "ephemeral"}}
    ],
    "messages": [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ],
    "tools": [{"name": "weather", "description": "w", "input_schema": {"type": "object", "properties": {}}}],
    "metadata": {"user_id": "u"},
    "stream": False,
}
RESPONSES_TEMPLATE: dict[str, Any] = {
    "model": "fake-model",
    "instructions": "You are helpful. Today is 2024-05-01.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ],
    "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}],
    "max_output_tokens": 5,
    "store": False,
    "stream": False,
}


class _Raw(str):
    """A JSON fragment spliced into the body as is (NaN, Infinity, a lone surrogate escape)."""


@dataclass
class HostileRequest:
    method: str
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    kind: str

    @property
    def valid_http(self) -> bool:
        """False when a header value holds a control character: not HTTP (RFC 9110 field-value),
        refused by the server's HTTP parser before the proxy sees it."""
        return not any((b < 32 and b != 9) or b == 127 for _, value in self.headers for b in value)

    def encode(self) -> bytes:
        lines = [f"{self.method} ".encode() + self.target + b" HTTP/1.1", b"host: fuzz", b"connection: close"]
        lines += [name + b": " + value for name, value in self.headers]
        if self.body or self.method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: " + str(len(self.body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


@dataclass
class HostileResponse:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class HostileHTTP:
    seed: int
    api_keys: list[str] = field(default_factory=list)
    admin_key: str | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # -- values ---------------------------------------------------------------------------------

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        choices: list[Any] = [
            None,
            True,
            False,
            0,
            -1,
            2**70,
            -(2**63) - 1,
            1.5,
            1e308,
            # Numbers as vLLM's pydantic models read them (proxy.http.reading): strings, floats, bools.
            "8",
            "1_000",
            " 3 ",
            8.0,
            "true",
            "false",
            _Raw("NaN"),
            _Raw("-Infinity"),
            "",
            "x",
            "user",
            "\u202e\u0000\ufeff",
            "😀" * 50,
            _Raw('"\\ud800"'),
            _Raw('"a\\udfff\\ud800b"'),
            "a" * rng.choice([1000, 100_000, 1_000_000]),
            [],
            {},
        ]
        if depth < 3:
            choices += [
                [self.value(depth + 1) for _ in range(rng.randint(1, 4))],
                {rng.choice(["role", "content", "function", "a", ""]): self.value(depth + 1)},
            ]
        choices.append(_Raw(self.deep(rng.choice([10, 63, 65, 200, 990, 5000]))))
        return rng.choice(choices)

    def deep(self, depth: int) -> str:
        opener, closer = self.rng.choice([("[", "]"), ('{"a":', "}")])
        return opener * depth + "1" + closer * depth

    # -- bodies ---------------------------------------------------------------------------------

    def mutated(self, template: dict[str, Any]) -> Any:
        body: Any = copy.deepcopy(template)
        for _ in range(self.rng.randint(1, 4)):
            body = self._mutate(body)
        return body

    def _mutate(self, body: Any) -> Any:
        if not isinstance(body, dict | list) or self.rng.random() < 0.05:
            return self.value()
        path: list[Any] = []
        node: Any = body
        while isinstance(node, dict | list) and node and self.rng.random() < 0.7:
            key = self.rng.choice(list(node)) if isinstance(node, dict) else self.rng.randrange(len(node))
            path.append(key)
            node = node[key]
        if not path:
            if isinstance(body, dict):
                body[self.rng.choice(["model", "messages", "tools", "extra", "stream"])] = self.value()
            return body
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if self.rng.random() < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = self.value()
        return body

    def dumps(self, value: Any) -> bytes:
        """JSON with the raw fragments spliced in."""
        fragments: dict[str, str] = {}

        def default(v: Any) -> Any:
            raise TypeError

        def mark(v: Any) -> Any:
            if isinstance(v, _Raw):
                token = f"@@raw{len(fragments)}@@"
                fragments[token] = str(v)
                return token
            if isinstance(v, dict):
                return {str(mark(k)) if isinstance(k, _Raw) else k: mark(x) for k, x in v.items()}
            if isinstance(v, list):
                return [mark(x) for x in v]
            return v

        text = json.dumps(mark(value), default=default)
        for token, fragment in fragments.items():
            text = text.replace(f'"{token}"', fragment)
        return text.encode("utf-8", "surrogatepass")

    def corrupt(self, raw: bytes) -> bytes:
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0 and raw:
            return raw[: rng.randrange(len(raw))]  # truncated
        if kind == 1:
            at = rng.randrange(len(raw) + 1)
            return (
                raw[:at]
                + rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80"])
                + raw[at:]
            )
        if kind == 2:
            return b"\xef\xbb\xbf" + raw  # BOM
        if kind == 3:
            return rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"{", b"NaN", b"{}" * 1000])
        if kind == 4:
            return raw.replace(b'"', b"'", 3)
        return raw + b"garbage"

    # -- requests -------------------------------------------------------------------------------

    def headers(self, body_route: bool) -> list[tuple[bytes, bytes]]:
        rng = self.rng
        headers: list[tuple[bytes, bytes]] = []
        content_types = [b"application/json"] * 6 + [
            b"text/plain",
            b"application/x-www-form-urlencoded",
            b"multipart/form-data; boundary=x",
            b"application/json; charset=latin-1",
            b"application/vnd.api+json",
            b"\xff\xfe",
            b"",
        ]
        if body_route and rng.random() < 0.95:
            headers.append((b"content-type", rng.choice(content_types)))
        keys = [k.encode() for k in self.api_keys] + [b"sk-wrong", b""]
        if self.admin_key:
            keys.append(self.admin_key.encode())
        valid = [k.encode() for k in self.api_keys] or [b"sk-any"]
        # Mostly a valid key: requests that pass authentication reach the code worth fuzzing.
        auth = rng.choice(
            [
                *[b"Bearer " + rng.choice(valid)] * 8,
                b"Bearer " + rng.choice(keys),
                b"Basic dXNlcjpwdw==",
                b"Bearer",
                b"bearer  " + rng.choice(keys) + b"  ",
                b"Bearer \xff\xfe\x80",
                b"Bearer " + b"k" * rng.choice([100, 8000]),
                None,
            ]
        )
        if auth is not None:
            headers.append((b"authorization", auth))
        if rng.random() < 0.3:
            name = rng.choice([b"x-session-id", b"x-request-id", b"x-openwebui-chat-id", b"x-anything"])
            value = rng.choice([b"s\xff\xfe", b"s" * rng.choice([10, 5000, 12000]), b"\x01\x7f", b"%00", b"a b c"])
            headers.append((name, value))
        return headers

    def request(self) -> HostileRequest:
        rng = self.rng
        roll = rng.random()
        if roll < 0.55:
            path, template = rng.choice(
                [
                    ("/v1/chat/completions", CHAT_TEMPLATE),
                    ("/v1/chat/completions", CHAT_TEMPLATE),
                    ("/v1/completions", COMPLETION_TEMPLATE),
                    ("/v1/embeddings", EMBEDDING_TEMPLATE),
                    ("/v1/messages", MESSAGES_TEMPLATE),
                    ("/v1/responses", RESPONSES_TEMPLATE),
                    ("/v1/responses/compact", {**RESPONSES_TEMPLATE, "stream": False}),
                    (rng.choice(GENERATION_PATHS), CHAT_TEMPLATE),
                ]
            )
            template = {**template, "stream": rng.random() < 0.3} if "stream" in template else template
            kind = "json"
            if rng.random() < 0.1:
                # An upstream that answers garbage, cuts its stream or hangs up on this request.
                template = {**template, "model": rng.choice(UPSTREAM_FAILURES)}
                kind = "upstream"
            raw = self.dumps(self.mutated(template))
            if rng.random() < 0.2:
                raw, kind = self.corrupt(raw), "upstream" if kind == "upstream" else "corrupt"
            if rng.random() < 0.25:
                path = respell(path, rng)[0]  # the same route, every spelling (or a 404)
            return HostileRequest("POST", path.encode(), self.headers(True), raw, kind)
        if roll < 0.65:
            # A route with a tail some router reads as nothing: 400 before any routing decision.
            path = rng.choice(GENERATION_PATHS + PATHS) + rng.choice(PATH_TAILS)
            body = self.dumps(self.mutated(CHAT_TEMPLATE))
            return HostileRequest(rng.choice(["POST", "GET"]), path.encode(), self.headers(True), body, "tail")
        if roll < 0.8:
            method, path = rng.choice(METHODS), rng.choice(PATHS)
            body = self.dumps(self.mutated(CHAT_TEMPLATE)) if method in ("POST", "PUT", "PATCH") else b""
            target = path.encode()
            if "sessions" in path and rng.random() < 0.5:
                target += b"?limit=" + rng.choice(LIMITS).encode()
            return HostileRequest(method, target, self.headers(bool(body)), body, "route")
        part = rng.choice(WEIRD_PATH_PARTS)
        path = rng.choice(
            [
                f"/v1/sessions/{part}",
                f"/admin/tenants/{part}/sessions",
                f"/admin/tenants/acme/sessions/{part}",
                f"/v1/{part}",
                f"/v1/sessions?limit={rng.choice(LIMITS)}&limit=2",
            ]
        )
        method = rng.choice(["GET", "DELETE", "POST"])
        body = self.dumps(self.mutated(CHAT_TEMPLATE)) if method == "POST" else b""
        return HostileRequest(method, path.encode(), self.headers(bool(body)), body, "path")

    def requests(self, count: int) -> Iterator[HostileRequest]:
        for _ in range(count):
            yield self.request()


def respell(path: str, rng: random.Random) -> tuple[str, bool]:
    """Another spelling of ``path`` that names the same route to a lenient server: repeated and
    trailing slashes, ``.`` and ``x/..`` segments, percent-encoded letters (the server decodes them
    once) and, now and then, letters in another case. Returns (spelling, whether the case changed:
    a case-sensitive route is then another route)."""
    out: list[str] = []
    case_changed = False
    for segment in path.strip("/").split("/"):
        out.append("/" * rng.choice([1, 1, 2, 3]))
        detour = rng.random()
        if detour < 0.15:
            out.append("./" + "/" * rng.choice([0, 1]))
        elif detour < 0.3:
            out.append(rng.choice(["x", "v1", "..."]) + "/../")
        chars = list(segment)
        for i, char in enumerate(chars):
            roll = rng.random()
            if char.isalnum() and roll < 0.1:
                chars[i] = f"%{ord(char):02X}" if rng.random() < 0.5 else f"%{ord(char):02x}"
            elif char.isalpha() and roll < 0.13:
                chars[i] = char.swapcase()
                case_changed = True
        out.append("".join(chars))
    out.append(rng.choice(["", "", "/", "//", "/.", "/./"]))
    return "".join(out), case_changed


def send(host: str, port: int, request: HostileRequest, timeout: float = 30.0) -> HostileResponse:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        # The server may answer (413, 415) and close before it read a large body: read the answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request.encode())
        response = http.client.HTTPResponse(sock, method=request.method)
        response.begin()
        body = response.read()
        return HostileResponse(response.status, {k.lower(): v for k, v in response.getheaders()}, body)


def _route(target: bytes) -> str | None:
    """The route a request target names, as the server decodes it and the proxy makes it canonical."""
    try:
        return canonical_path(unquote(target.split(b"?")[0].decode("latin-1")))
    except InvalidPath:
        return None


def problem(request: HostileRequest, response: HostileResponse) -> str | None:
    """What is wrong with a response to a hostile request, or None: a status >= 500, or an error
    whose body is not OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages``)."""
    if response.status >= 500 and not (request.kind == "upstream" and response.status in (502, 504)):
        # (a request naming a failing upstream behaviour may get that upstream's failure, as a 502 or 504)
        return f"status {response.status}"
    if response.status < 400 or request.method == "HEAD":
        return None
    if not request.valid_http and response.status == 400:
        return None  # uvicorn's own answer to what is not HTTP
    if _route(request.target) in ("/v1/messages", "/v1/messages/count_tokens") and request.method == "POST":
        return _anthropic_problem(response)
    try:
        error = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {response.status} with a body that is not an OpenAI error: {response.body[:120]!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"status {response.status}: error object {error!r:.120}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"status {response.status}: empty message"
    if not response.headers.get("content-type", "").startswith("application/json"):
        return f"status {response.status}: content-type {response.headers.get('content-type')}"
    return None


def _anthropic_problem(response: HostileResponse) -> str | None:
    try:
        payload = json.loads(response.body)
        error = payload["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {response.status} with a body that is not an Anthropic error: {response.body[:120]!r}"
    if payload.get("type") != "error" or not isinstance(error, dict) or set(error) != {"type", "message"}:
        return f"status {response.status}: Anthropic error {payload!r:.120}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"status {response.status}: empty message"
    return None


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    # Requests that were not HTTP (control characters in a header), answered by uvicorn's parser.
    not_http: int = 0

    def add(self, request: HostileRequest, response: HostileResponse) -> None:
        self.requests += 1
        self.statuses[response.status] += 1
        self.not_http += not request.valid_http
        wrong = problem(request, response)
        if wrong is not None:
            self.problems.append(f"{request.kind} {request.method} {request.target[:80]!r}: {wrong}")

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items()))
        return (
            f"{self.requests} requests ({self.not_http} not HTTP, refused by the server's parser); "
            f"statuses {statuses}; {len(self.problems)} problems"
        )


def run(host: str, port: int, requests: Iterable[HostileRequest], workers: int = 4) -> FuzzReport:
    """Send every request (``workers`` at a time) and check every answer."""
    requests = list(requests)
    report = FuzzReport()
    with ThreadPoolExecutor(workers) as pool:
        for request, response in zip(requests, pool.map(lambda r: send(host, port, r), requests), strict=True):
            report.add(request, response)
    return report
