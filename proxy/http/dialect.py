"""How a protocol spells errors: in a JSON answer, in an upstream error passed on, mid-stream.

The OpenAI dialect is what every route used so far (``proxy.http.errors``); Anthropic clients expect
``{"type": "error", "error": {"type", "message"}}`` and SSE ``event: error``, and their SDKs only
raise a typed exception for that shape.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.http.errors import ProxyError, error_body, normalize_upstream_error

_EVENT_END = b"\n\n"


class ErrorDialect:
    """OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def body(self, error: ProxyError) -> dict[str, Any]:
        return error.body()

    def upstream_body(self, status: int, raw: bytes) -> bytes:
        """An upstream error body, passed on as it is when it already has this shape."""
        return normalize_upstream_error(status, raw)

    def stream_event(self, message: str, code: str) -> bytes:
        """An SSE event that ends a stream with an error (the SDK raises it)."""
        payload = error_body(message, "upstream_error", None, code)
        return b"data: " + json.dumps(payload).encode() + _EVENT_END


OPENAI = ErrorDialect()


class ResponsesDialect(ErrorDialect):
    """The Responses API: errors in OpenAI's shape; a stream ends with its ``error`` event
    (``type``, ``code``, ``message``, ``param``), which also holds the OpenAI ``error`` object the
    SDKs raise on: a client that reads events by ``type`` and one whose SDK raises both see it."""

    def stream_event(self, message: str, code: str) -> bytes:
        payload = {
            "type": "error",
            "code": code,
            "message": message,
            "param": None,
            **error_body(message, "upstream_error", None, code),
        }
        return b"event: error\ndata: " + json.dumps(payload).encode() + _EVENT_END


RESPONSES_API = ResponsesDialect()

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    if status in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


class AnthropicDialect(ErrorDialect):
    """``{"type": "error", "error": {"type", "message"}}``; streams end with ``event: error``."""

    def body(self, error: ProxyError) -> dict[str, Any]:
        return anthropic_error_body(error.status, error.message)

    def upstream_body(self, status: int, raw: bytes) -> bytes:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("type") == "error" and isinstance(parsed.get("error"), dict):
            return raw  # vLLM's /v1/messages answers its own errors in this shape
        # vLLM answers request-validation errors of /v1/messages in OpenAI's shape; anything else
        # (HTML from a gateway, plain text) is summarized, never copied (proxy.http.errors).
        openai = json.loads(normalize_upstream_error(status, raw))
        message = str(openai["error"].get("message") or f"upstream returned HTTP {status}")
        return json.dumps(anthropic_error_body(status, message)).encode()

    def stream_event(self, message: str, code: str) -> bytes:
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(payload).encode() + _EVENT_END


ANTHROPIC = AnthropicDialect()
