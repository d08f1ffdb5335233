"""The errors the proxy answers itself, as a tree of types, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

Modelled on httpx's exception tree: what went wrong is the class, so code that decides on an error
matches its type (``except UpstreamUnreachable``, ``isinstance(error, UpstreamTimeout)``), never its
status or its code. Each class carries its HTTP status and the body's ``type`` and ``code`` as class
attributes, in one place; an instance carries its message (and ``param``, headers)::

    ProxyError                        anything the proxy answers itself
    ├── ClientError                   4xx: the request, or its client, is at fault
    │   ├── InvalidRequest            400 (no code): a body or parameter of the wrong type
    │   │   ├── ContextLengthExceeded 400 context_length_exceeded (param messages)
    │   │   ├── BodyTooDeep           400 too_deep (a passed-through body)
    │   │   ├── UnroutablePath        400 invalid_path
    │   │   └── InvalidLimit          400 invalid_limit (param limit)
    │   ├── Unauthorized              401 invalid_api_key (www-authenticate: Bearer)
    │   ├── Forbidden                 403 (no code), type permission_error
    │   ├── NotFound                  404 not_found, type not_found_error
    │   │   ├── SessionNotFound       404 session_not_found
    │   │   └── ResponseNotFound      404 "404", type invalid_request_error (OpenAI's own)
    │   ├── RequestTimeout            408 request_timeout: the body did not arrive in time
    │   ├── PayloadTooLarge           413 request_too_large
    │   ├── UnsupportedMediaType      415 unsupported_media_type
    │   ├── BudgetExceeded            429 <kind>_budget_exceeded, type rate_limit_error (retry-after)
    │   └── ClientDisconnected        499 client_disconnected: the client left mid-upload
    └── ServerError                   5xx, type server_error: the proxy or its upstream failed
        ├── ServiceUnavailable        503 store_unavailable: a store the proxy needs is down
        └── UpstreamError             type upstream_error: the upstream did not answer properly
            ├── UpstreamUnreachable   502 upstream_unreachable: never sent (safe to send elsewhere)
            ├── UpstreamConnectionLost 502 upstream_connection_lost: lost after sending (never resent)
            ├── UpstreamProtocolError 502 upstream_invalid_response: an answer that is not the protocol
            └── UpstreamTimeout       504 upstream_timeout
                └── DeadlineExceeded  504 request_deadline_exceeded: the request's overall deadline

The base class, given a status, type and code of its own, answers an error no class names (an
extension's, a test's); the proxy raises the classes.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


class ProxyError(Exception):
    """An error the proxy answers itself, with an OpenAI-style body (see the module's tree)."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

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
        self.status = status
        self.type = type
        self.code = code
        self._describe(message, param, headers)

    def _describe(self, message: str, param: str | None, headers: dict[str, str] | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, extra_headers: dict[str, str] | None = None) -> Response:
        return json_response(self.body(), self.status, {**self.headers, **(extra_headers or {})})


# -- 4xx: the request, or its client, is at fault -------------------------------------------------


class ClientError(ProxyError):
    """4xx: what the client sent (or did not send) is at fault; another backend would answer the same."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        self._describe(message, param, headers)


class InvalidRequest(ClientError):
    """400: a body or parameter the proxy reads is not what the API gives it (``param`` names it)."""


class ContextLengthExceeded(InvalidRequest):
    """400: the conversation does not fit its context budget (``context_limit_tokens``)."""

    code = "context_length_exceeded"

    def __init__(self, estimate: int, limit: int) -> None:
        super().__init__(
            f"This conversation needs about {estimate} tokens, over its context budget of {limit} tokens "
            "(context_limit_tokens). Shorten the history.",
            param="messages",
        )


class BodyTooDeep(InvalidRequest):
    """400: a passed-through JSON body nests deeper than any backend needs (a parser may not survive it)."""

    code = "too_deep"

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"request body nests deeper than {max_depth} levels")


class UnroutablePath(InvalidRequest):
    """400: a path that names no route in any spelling (:class:`proxy.http.paths.InvalidPath`)."""

    code = "invalid_path"

    def __init__(self) -> None:
        super().__init__("the path names no route (dot segments above the root, or an encoded separator)")


class InvalidLimit(InvalidRequest):
    """400: a listing's ``?limit=`` that is not a positive integer."""

    code = "invalid_limit"

    def __init__(self) -> None:
        super().__init__("'limit' must be a positive integer", param="limit")


class Unauthorized(ClientError):
    """401: no key, or one that matches nothing (a tenant's, the admin key, the metrics key)."""

    status = 401
    code = "invalid_api_key"

    def __init__(self, message: str = "invalid or missing API key") -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class Forbidden(ClientError):
    """403: what the caller asks for is switched off (the admin API without an admin key)."""

    status = 403
    type = "permission_error"


class NotFound(ClientError):
    """404: no such route (or one the configuration does not forward)."""

    status = 404
    type = "not_found_error"
    code = "not_found"


class SessionNotFound(NotFound):
    """404: the admin API's session does not exist (for this tenant)."""

    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r}")


class ResponseNotFound(NotFound):
    """404: a stored response the proxy does not know, in the words and shape OpenAI answers it."""

    type = "invalid_request_error"
    code = "404"

    def __init__(self, response_id: str, param: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param=param)


class RequestTimeout(ClientError):
    """408: the body did not arrive within the server's read deadline (:mod:`proxy.http.inbound`)."""

    status = 408
    code = "request_timeout"

    def __init__(self) -> None:
        super().__init__("the request did not arrive within the server's read deadline")


class PayloadTooLarge(ClientError):
    """413: the body passed ``max_body_bytes``: the one place its message is written."""

    status = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes")


class UnsupportedMediaType(ClientError):
    """415: a body not declared JSON (what a web page can make a browser send cross-site)."""

    status = 415
    code = "unsupported_media_type"

    def __init__(self) -> None:
        super().__init__("the request body must be JSON, sent with content-type: application/json")


class BudgetExceeded(ClientError):
    """429: a usage budget of the window is spent. The code names the budget (``tenant_budget_exceeded``,
    ``session_budget_exceeded``, ...); ``Retry-After`` says when the window frees enough."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, kind: str, retry_after_s: int) -> None:
        super().__init__(
            f"The {kind} token budget for this window is spent; retry after {retry_after_s} s.",
            headers={"retry-after": str(retry_after_s)},
        )
        self.code = f"{kind}_budget_exceeded"


class ClientDisconnected(ClientError):
    """499 (nginx's "client closed request"): the client hung up before its whole body arrived.
    Nobody reads the answer; the access log records it."""

    status = 499
    code = "client_disconnected"

    def __init__(self) -> None:
        super().__init__("the client closed the connection before sending the whole body")


# -- 5xx: the proxy or its upstream failed --------------------------------------------------------


class ServerError(ProxyError):
    """5xx: the request may be fine; the proxy, or what it depends on, failed it."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        self._describe(message, param, headers)


class ServiceUnavailable(ServerError):
    """503: a store the proxy needs to answer (tenants' keys, the session store) cannot be reached."""

    status = 503
    code = "store_unavailable"


class UpstreamError(ServerError):
    """502/504: the upstream did not answer, or not in its protocol (counted in
    ``prefix_proxy_upstream_errors_total``: :func:`proxy.backends.upstream.upstream_error_kind`)."""

    status = 502
    type = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    """502: the request never left (connection refused, DNS, connect or pool timeout): another
    backend may take it."""

    code = "upstream_unreachable"

    def __init__(self, detail: str) -> None:
        super().__init__(f"upstream unreachable: {detail}")


class UpstreamConnectionLost(UpstreamError):
    """502: the connection broke after the request was sent, before or while its answer came: unlike
    :class:`UpstreamUnreachable`, not safe to send again elsewhere (the upstream may have computed it)."""

    code = "upstream_connection_lost"

    def __init__(self, detail: str) -> None:
        super().__init__(f"upstream closed the connection: {detail}")


class UpstreamProtocolError(UpstreamError):
    """502: a whole answer that is not the protocol's (not JSON, not an object, without its list)."""

    code = "upstream_invalid_response"

    def __init__(self, why: str) -> None:
        super().__init__(f"the upstream answered with an invalid response: {why}")


class UpstreamTimeout(UpstreamError):
    """504: the upstream took longer than a read may (``upstream_timeout_s``)."""

    status = 504
    code = "upstream_timeout"

    def __init__(self, message: str = "upstream timed out") -> None:
        super().__init__(message)


class DeadlineExceeded(UpstreamTimeout):
    """504: the request's overall deadline (``request_timeout_s``) passed while the upstream worked
    (an upstream that drips a byte at a time trips no read timeout)."""

    code = "request_deadline_exceeded"

    def __init__(self) -> None:
        super().__init__("the request exceeded its deadline")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_bytes(payload: Any) -> bytes:
    try:
        return json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (from a client's JSON escape): ASCII escapes it
        return json.dumps(payload).encode()


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(payload), status_code=status, headers=headers, media_type="application/json")


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
    elif isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        message = parsed["error"][:2000]  # TGI's {"error": "...", "error_type": "validation"}
    else:
        message = f"upstream returned HTTP {status}"
    error_type = "invalid_request_error" if status < 500 else "upstream_error"
    return json.dumps(error_body(message, error_type, None, str(status))).encode()
