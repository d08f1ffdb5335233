"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


class ProxyError(Exception):
    """An error the proxy answers itself, with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, extra_headers: dict[str, str] | None = None) -> Response:
        return json_response(self.body(), self.status, {**self.headers, **(extra_headers or {})})


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_bytes(payload: Any) -> bytes:
    try:
        return json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (from a client's JSON escape): ASCII escapes it
        return json.dumps(payload).encode()


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(payload), status_code=status, headers=headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


def upstream_unreachable(detail: str) -> ProxyError:
    return ProxyError(502, f"upstream unreachable: {detail}", type="upstream_error", code="upstream_unreachable")


def upstream_connection_lost(detail: str) -> ProxyError:
    """The connection broke after the request was sent: unlike :func:`upstream_unreachable`, not
    safe to send again elsewhere (the upstream may have computed it)."""
    return ProxyError(
        502, f"upstream closed the connection: {detail}", type="upstream_error", code="upstream_connection_lost"
    )


def upstream_timeout() -> ProxyError:
    return ProxyError(504, "upstream timed out", type="upstream_error", code="upstream_timeout")


def invalid_upstream_response(why: str) -> ProxyError:
    return ProxyError(
        502,
        f"the upstream answered with an invalid response: {why}",
        type="upstream_error",
        code="upstream_invalid_response",
    )


def normalize_upstream_error(status: int, raw: bytes) -> bytes:
    """Pass an upstream error body through, wrapping it only when it is not OpenAI-shaped.

    Some OpenAI-compatible servers answer errors with plain text or HTML; clients
    (the openai SDK included) expect JSON with an ``error`` object. A body that is
    not JSON is not copied into the message: an HTML error page or a plain-text
    traceback of the upstream (or of a gateway in front of it) is not for clients.
    """
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return raw
    if isinstance(parsed, dict) and "message" in parsed:
        message = str(parsed["message"])[:2000]
    elif isinstance(parsed, dict) and "detail" in parsed:
        message = str(parsed["detail"])[:2000]
    else:
        message = f"upstream returned HTTP {status}"
    error_type = "invalid_request_error" if status < 500 else "upstream_error"
    return json.dumps(error_body(message, error_type, None, str(status))).encode()
