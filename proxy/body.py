"""Reading and validating request bodies before anything is sent upstream."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from proxy.errors import ProxyError, bad_request
from proxy.jsonio import loads

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


async def read_body(request: Request, limit: int) -> bytes:
    """Read the raw body, refusing it with 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    return model


def validate_chat_request(body: dict[str, Any]) -> None:
    """Reject what no backend could answer, with the offending parameter named."""
    require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object", param=f"messages[{index}]")
        role = message.get("role")
        if role not in VALID_ROLES:
            raise bad_request(f"messages[{index}].role {role!r} is not a valid role", param=f"messages[{index}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(
                f"messages[{index}].content must be a string or an array", param=f"messages[{index}].content"
            )
    for key in ("tools", "functions"):
        value = body.get(key)
        if value is not None and not isinstance(value, list):
            raise bad_request(f"'{key}' must be an array", param=key)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")


def validate_completion_request(body: dict[str, Any]) -> None:
    require_model(body)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", param="prompt")
