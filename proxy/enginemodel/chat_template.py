"""Qwen2.5-Instruct chat template, in pure Python and as the identical Jinja source.

The engine model (``prefix-proxy analyze``, the fake backend) must render prompts byte for byte
as a real vLLM serving a Qwen2.5 model would, because prefix-cache hits are decided on the token
ids of that rendering. Two steps happen in vLLM before the template runs, and both are mirrored
here:

* ``normalize_messages`` is vLLM's ``parse_chat_messages`` for a "string" content-format
  template: list content becomes its text parts joined by ``"\\n"``, ``None`` becomes ``""``,
  and assistant ``tool_calls[].function.arguments`` JSON strings are parsed into dicts
  (``_postprocess_messages``; invalid JSON or a non-object becomes ``{}``), so the template's
  ``tojson`` re-serializes them with ``json.dumps`` default separators. A client that re-sends
  the argument string the server produced therefore renders the same bytes the model
  generated; one that re-formats it (compact separators, other key order) does not.
* ``normalize_tools`` is vLLM's ``[tool.model_dump() for tool in request.tools]``: pydantic puts
  the declared fields first, in declaration order (``type``, ``function``; inside it ``name``,
  ``description``, ``parameters``), fills absent ones with ``None`` (rendered ``null``) and
  keeps unknown function fields (``strict``...) after them in received order. Key order
  *inside* ``parameters`` is kept exactly as received.

``render_chat`` = normalize + ``render_normalized``; ``QWEN_STYLE_CHAT_TEMPLATE`` rendered by a
Hugging Face style Jinja environment over the normalized input gives the same string.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

# Qwen2.5-Instruct's tokenizer_config.json chat_template, verbatim. Hugging Face renders it with
# trim_blocks/lstrip_blocks and a ``tojson`` filter that is plain json.dumps(ensure_ascii=False).
QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Text part types vLLM flattens into a string-format template's content.
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_FUNCTION_FIELDS = ("name", "description", "parameters")
_UNDEFINED = object()


class ChatTemplateError(ValueError):
    """The request cannot be rendered (vLLM answers these with HTTP 400)."""


def tojson(value: Any) -> str:
    """Hugging Face's ``tojson`` filter: json.dumps with default separators, no key sorting."""
    return json.dumps(value, ensure_ascii=False)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render an OpenAI-style request exactly as vLLM + the Qwen2.5 template would."""
    normalized = normalize_messages(messages)
    text = render_normalized(normalized, normalize_tools(tools), add_generation_prompt and not continue_final_message)
    if continue_final_message:
        text = _open_final_message(text, normalized)
    return text


def render_normalized(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> str:
    """The template itself, over already-normalized messages and tools (what Jinja sees)."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out: list[str] = []
    first_is_system = messages[0].get("role") == "system"
    if tools:
        out.append(IM_START + "system\n")
        out.append(messages[0]["content"] if first_is_system else DEFAULT_SYSTEM_PROMPT)
        out.append(TOOLS_PREAMBLE)
        for tool in tools:
            out.append("\n")
            out.append(tojson(tool))
        out.append(TOOLS_POSTAMBLE)
    elif first_is_system:
        out.append(IM_START + "system\n" + messages[0]["content"] + IM_END + "\n")
    else:
        out.append(IM_START + "system\n" + DEFAULT_SYSTEM_PROMPT + IM_END + "\n")

    last = len(messages) - 1
    for i, message in enumerate(messages):
        role = message.get("role")
        tool_calls = message.get("tool_calls")
        if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not tool_calls):
            out.append(IM_START + str(role) + "\n" + message["content"] + IM_END + "\n")
        elif role == "assistant":
            out.append(IM_START + "assistant")
            if message.get("content"):
                out.append("\n" + message["content"])
            for call in tool_calls or ():
                function = call.get("function", call) if isinstance(call, Mapping) else call
                out.append('\n<tool_call>\n{"name": "')
                out.append(_jinja_str(function.get("name", _UNDEFINED)))
                out.append('", "arguments": ')
                out.append(tojson(function.get("arguments")))
                out.append("}\n</tool_call>")
            out.append(IM_END + "\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append(IM_START + "user")
            out.append("\n<tool_response>\n" + message["content"] + "\n</tool_response>")
            if i == last or messages[i + 1].get("role") != "tool":
                out.append(IM_END + "\n")
        # Any other role (e.g. "developer", or "system" first) renders nothing, as in Jinja.
    if add_generation_prompt:
        out.append(IM_START + "assistant\n")
    return "".join(out)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's message preprocessing for a string-content template (never mutates the input)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ChatTemplateError("messages must be a list")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    normalized: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] must be an object with a string 'role'")
        role = message["role"]
        out: dict[str, Any] = {"role": role, "content": _flatten_content(message.get("content"), index)}
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _normalize_tool_calls(message["tool_calls"], index)
            if calls:
                out["tool_calls"] = calls
        if role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        normalized.append(out)
    return normalized


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``ChatCompletionToolsParam.model_dump()`` for each tool."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ChatTemplateError("tools must be a list")
    normalized: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{index}] must be an object")
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"tools[{index}].type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"tools[{index}].function must be an object with a string 'name'")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ChatTemplateError(f"tools[{index}].function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ChatTemplateError(f"tools[{index}].function.parameters must be an object")
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": description,
            "parameters": copy.deepcopy(dict(parameters)) if parameters is not None else None,
        }
        for key, value in function.items():
            if key not in _FUNCTION_FIELDS:
                dumped[key] = copy.deepcopy(value)
        normalized.append({"type": "function", "function": dumped})
    return normalized


def _flatten_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{index}].content parts must be objects")
        part_type = part.get("type")
        if part_type not in _TEXT_PART_TYPES:
            raise ChatTemplateError(f"Unsupported content part type {part_type!r}: this model is text-only")
        text = part.get("text")
        if text is None:
            continue  # vLLM skips text parts with no text
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{index}].content text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _normalize_tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"messages[{index}].tool_calls must be a list")
    calls: list[dict[str, Any]] = []
    for call in tool_calls:
        if not isinstance(call, Mapping):
            raise ChatTemplateError("assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ChatTemplateError("chat completions only support assistant tool_calls of type 'function'.")
        new_call = copy.deepcopy(dict(call))
        new_function = new_call["function"]
        new_function["arguments"] = _parse_arguments(function.get("arguments"))
        calls.append(new_call)
    return calls


def _parse_arguments(arguments: Any) -> Any:
    # vLLM: falsy -> {}; dict kept; JSON string parsed; anything that is not an object -> {}.
    if not arguments:
        return {}
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _jinja_str(value: Any) -> str:
    # Jinja prints an undefined attribute as "" and anything else through str() (None -> "None").
    if value is _UNDEFINED:
        return ""
    return value if isinstance(value, str) else str(value)


def _open_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    # Hugging Face's continue_final_message (what vLLM calls): cut the rendering right after the
    # last occurrence of the final message's stripped content, leaving that turn open.
    final = str(messages[-1].get("content") or "").strip()
    cut = text.rfind(final)
    if not final or cut < 0:
        raise ChatTemplateError("continue_final_message needs a final message with content")
    return text[: cut + len(final)]
