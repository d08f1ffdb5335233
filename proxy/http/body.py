"""Reading and validating request bodies before anything is sent upstream.

Validation checks types, not semantics: whatever the proxy itself reads from a
request (roles, content, tool calls, tools) must have the type OpenAI's API
gives it, so that a malformed request is answered 400 naming the parameter
instead of failing somewhere inside canonicalization or session inference.
What the proxy does not read is left for the backend to judge.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from proxy.http import reading
from proxy.http.errors import ClientDisconnected, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from proxy.openai import (
    MAX_DEPTH,
    Continuations,
    TooDeep,
    check_depth,
    check_depth_once,
    leading_system_count,
    loads,
    resumed_loads,
    reuse_texts,
)

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# A message's fields checked beyond its role and content.
_CHECKED_FIELDS = frozenset({"name", "tool_call_id", "tool_calls", "function_call"})
# Longer than any served model name (Hugging Face ids and local paths included); a model name ends
# up in log lines and metrics, so it is kept short.
MAX_MODEL_CHARS = 256


async def read_body(request: Request, limit: int) -> bytes:
    """Read the raw body, refusing it with 413 as soon as it passes ``limit`` bytes."""
    require_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client hung up mid-upload: nobody reads the answer, but the access log records it
        # (499, nginx's "client closed request") instead of an ERROR traceback.
        raise ClientDisconnected() from None
    return b"".join(chunks)


def require_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON.

    ``text/plain``, form and multipart bodies (and bodies with no type at all) are what a browser
    sends cross-site without a CORS preflight: refusing them keeps a web page from spending an open
    proxy's GPUs through its visitors' browsers. Every OpenAI client sends ``application/json``.
    """
    if json_media_type(media_type_of(request)):
        return
    raise UnsupportedMediaType()


def media_type_of(request: Request) -> str:
    """The body's media type, lowercase, without parameters ("" where none is given)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def json_media_type(media_type: str) -> bool:
    """``application/json`` or a ``+json`` type, both of which FastAPI (vLLM) parses as JSON."""
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def parsed_by_engines(media_type: str) -> bool:
    """A body an engine reads as JSON: a JSON type; no type at all, which FastAPI parses as JSON too;
    and ``text/plain``, which llama-server parses as JSON whatever the type says."""
    return media_type in ("", "text/plain") or json_media_type(media_type)


def parse_json_object(raw: bytes, namespace: str | None = None) -> dict[str, Any]:
    """The body as a JSON object nesting at most ``MAX_DEPTH`` levels (InvalidRequest otherwise).

    With ``namespace`` (the tenant), its tool list, which a client re-sends unchanged on every
    request and which holds most of a body's nesting (JSON schemas), is checked once per tenant
    and list (``check_depth_once``); the rest of the body every time. And its long non-ASCII texts
    that the tenant sent last are the strings made then (``proxy.openai.recurring``): equal, with
    their UTF-8 form already made."""
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = loads(raw) if namespace is None else resumed_loads(raw, namespace)
        if namespace is not None and isinstance(body, dict):
            _check_nesting(body, namespace)
        else:
            check_depth(body, MAX_DEPTH)
    except TooDeep:
        raise InvalidRequest(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if namespace is not None:
        reuse_texts(body, namespace)
    return body


# Per tenant and conversation, the client's last message list, as far as it passed the checks here
# (within the nesting bound; each protocol's validation, a part of its own: a list valid as chat's
# need not be valid as Anthropic's): a message nests as deep as an equal one and is as valid, so the
# next request checks only the messages it adds.
CHECKED_MESSAGES: Continuations[None] = Continuations()


def _check_nesting(body: dict[str, Any], namespace: str) -> None:
    """``check_depth(body, MAX_DEPTH)``, leaving out what the tenant sent within the bound before:
    its tool list (``check_depth_once``) and the messages its conversation's last request sent."""
    rest = body
    tools = body.get("tools")
    if isinstance(tools, list):
        rest = {key: value for key, value in body.items() if key != "tools"}
        check_depth_once(tools, namespace, MAX_DEPTH - 1)  # a level below the body's
    messages = body.get("messages")
    if not isinstance(messages, list):
        check_depth(rest, MAX_DEPTH)
        return
    lead = leading_system_count(messages, MAX_LEADING_SYSTEM)
    history = messages[lead:] if lead else messages
    resumed = CHECKED_MESSAGES.resume(namespace, history, "nesting")
    if resumed.shared:
        rest = {**rest, "messages": [*messages[:lead], *history[resumed.shared :]]}
    check_depth(rest, MAX_DEPTH)
    resumed.keep(history, None)


# Leading system messages looked at, at most, before the history a conversation re-sends: checks
# that judge each message on its own resume on the history after them, so a system prompt that
# changes (a Dify clock) does not make them judge the whole history again.
MAX_LEADING_SYSTEM = 8


def is_text(value: Any) -> bool:
    """A string that is valid Unicode (JSON's ``\\ud800`` escapes decode to lone surrogates, which
    cannot be written as UTF-8: not in a log line, a metric label or a header)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", param="model")
    if len(model) > MAX_MODEL_CHARS or not is_text(model):
        raise InvalidRequest(
            f"'model' must be valid Unicode text of at most {MAX_MODEL_CHARS} characters", param="model"
        )
    return model


def _optional(value: Any, kind: type | tuple[type, ...], param: str, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise InvalidRequest(f"{param} must be {what}", param=param)


def validate_chat_request(body: dict[str, Any], namespace: str | None = None) -> None:
    """Reject what no backend could answer, with the offending parameter named. ``namespace``: the
    tenant, whose conversation's messages validated before are not validated again."""
    reading.CHAT.read(body)
    require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    lead = leading_system_count(messages, MAX_LEADING_SYSTEM) if namespace is not None else 0
    history = messages[lead:] if lead else messages
    resumed = CHECKED_MESSAGES.resume(namespace, history, "chat validation") if namespace is not None else None
    for index in range(lead):
        if not _valid_message(messages[index]):
            _validate_message(messages[index], f"messages[{index}]")
    for index in range(resumed.shared if resumed is not None else 0, len(history)):
        message = history[index]
        if not _valid_message(message):
            _validate_message(message, f"messages[{lead + index}]")
    for key in ("tools", "functions"):
        value = body.get(key)
        _optional(value, list, key, "an array")
        for index, tool in enumerate(value or ()):
            if not _valid_tool(tool):
                _validate_tool(tool, f"{key}[{index}]")
    stream_options = body.get("stream_options")
    _optional(stream_options, dict, "stream_options", "an object")
    _optional(body.get("tool_choice"), (str, dict), "tool_choice", "a string or an object")
    _optional(body.get("response_format"), dict, "response_format", "an object")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        # bool is an int to Python; to JSON (and to the budget arithmetic) it is not a number.
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidRequest(f"'{key}' must be an integer", param=key)
    if resumed is not None:
        resumed.keep(history, None)


def _valid_message(message: Any) -> bool:
    """Whether :func:`_validate_message` passes the message: its checks, without naming the parameter
    each would report (an f-string per field), for every message of a history on every request. A
    value of a subclass (never parsed JSON) fails here and is judged by the full check."""
    if type(message) is not dict:
        return False
    role = message.get("role")
    if type(role) is not str or role not in VALID_ROLES:
        return False
    content = message.get("content")
    if type(content) is str and message.keys().isdisjoint(_CHECKED_FIELDS):
        return True  # the common shape: nothing else to check
    if content is not None and type(content) is not str:
        if type(content) is not list:
            return False
        for part in content:
            kind = part.get("type") if type(part) is dict else None
            if type(part) is not dict or (kind is not None and type(kind) is not str):
                return False
            if kind == "text" and type(part.get("text")) is not str:
                return False
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None and type(value) is not str:
            return False
    calls = message.get("tool_calls")
    if calls is not None:
        if type(calls) is not list:
            return False
        for call in calls:
            if type(call) is not dict:
                return False
            call_id, function = call.get("id"), call.get("function")
            if (call_id is not None and type(call_id) is not str) or type(function) is not dict:
                return False
            name = function.get("name")
            if name is not None and type(name) is not str:
                return False
    function_call = message.get("function_call")
    return function_call is None or type(function_call) is dict


def _valid_tool(tool: Any) -> bool:
    """Whether :func:`_validate_tool` passes the tool (its checks, no parameter named)."""
    if type(tool) is not dict:
        return False
    function = tool.get("function", tool if "name" in tool else None)
    if function is None:
        return True
    if type(function) is not dict:
        return False
    name, parameters = function.get("name"), function.get("parameters")
    return (name is None or type(name) is str) and (parameters is None or type(parameters) is dict)


def _validate_message(message: Any, param: str) -> None:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in VALID_ROLES:
        shown = role if isinstance(role, str) and is_text(role) else type(role).__name__
        raise InvalidRequest(f"{param}.role {shown!r} is not a valid role"[:300], param=f"{param}.role")
    content = message.get("content")
    _optional(content, (str, list), f"{param}.content", "a string or an array")
    if isinstance(content, list):
        for index, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"{param}.content[{index}] must be an object (a content part)", param=f"{param}.content[{index}]"
                )
            # A part's type names its kind (vLLM's parts are told apart by it: anything but a string
            # is a 400 there); a text part's text is what the proxy reads, a string as vLLM requires.
            kind = part.get("type")
            if kind is not None and not isinstance(kind, str):
                raise InvalidRequest(
                    f"{param}.content[{index}].type must be a string", param=f"{param}.content[{index}].type"
                )
            if kind == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"{param}.content[{index}].text must be a string", param=f"{param}.content[{index}].text"
                )
    for key in ("name", "tool_call_id"):
        _optional(message.get(key), str, f"{param}.{key}", "a string")
    calls = message.get("tool_calls")
    _optional(calls, list, f"{param}.tool_calls", "an array")
    for index, call in enumerate(calls or ()):
        call_param = f"{param}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise InvalidRequest(f"{call_param} must be an object", param=call_param)
        _optional(call.get("id"), str, f"{call_param}.id", "a string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{call_param}.function must be an object", param=f"{call_param}.function")
        _optional(function.get("name"), str, f"{call_param}.function.name", "a string")
    _optional(message.get("function_call"), dict, f"{param}.function_call", "an object")


def _validate_tool(tool: Any, param: str) -> None:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    function = tool.get("function", tool if "name" in tool else None)
    _optional(function, dict, f"{param}.function", "an object")
    if isinstance(function, dict):
        _optional(function.get("name"), str, f"{param}.function.name", "a string")
        _optional(function.get("parameters"), dict, f"{param}.function.parameters", "an object")


def validate_completion_request(body: dict[str, Any]) -> None:
    reading.COMPLETIONS.read(body)
    require_model(body)
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required", param="prompt")
    stream_options = body.get("stream_options")
    _optional(stream_options, dict, "stream_options", "an object")
