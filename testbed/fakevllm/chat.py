"""Chat-specific rules: vLLM's tool_choice handling, and what the fake model emits for it."""

from __future__ import annotations

import json
from typing import Any

from testbed.fakevllm.protocol import ChatCompletionRequest, Rejected
from testbed.fakevllm.replies import ToolCallReply, plan_reply, tool_call_for
from testbed.fakevllm.toolcalls import ParsedOutput, ToolMode

ROLE_DELTA: dict[str, Any] = {"role": "assistant", "content": ""}


def tool_mode(req: ChatCompletionRequest) -> ToolMode:
    """vLLM's tool_choice validation, returning how the output will be parsed.

    tool_choice defaults to "auto" when tools are given (the server is assumed to run with
    ``--enable-auto-tool-choice --tool-call-parser hermes``); "required" with an empty tool
    list behaves as "none", as in vLLM.
    """
    choice = req.tool_choice
    if choice is None or choice == "none":
        return "auto" if choice is None and req.tools else "none"
    if req.tools is None:
        raise Rejected(400, "When using `tool_choice`, `tools` must be set.")
    if choice == "required":
        return "required" if req.tools else "none"
    if choice == "auto":
        return "auto"
    name = req.named_tool
    if name is None:
        raise Rejected(
            400,
            'Invalid `tool_choice`. Correct usage: `{"type": "function", "function": {"name": "my_function"}}`',
        )
    names = {t.get("function", {}).get("name") for t in req.tools if isinstance(t, dict)}
    if name not in names:
        raise Rejected(400, "The tool specified in `tool_choice` does not match any of the specified `tools`")
    return "named"


def reply_text(prompt_text: str, mode: ToolMode, named: str | None, tools: list[Any] | None) -> str:
    """What the fake model emits; for forced tool choices, what guided decoding makes it emit.

    A named tool choice makes vLLM constrain the output to the arguments object, "required"
    to ``[{"name": ..., "parameters": ...}]``. Neither is what the template renders back in
    history, so (as with a real vLLM) those generated tokens do not hit on the next turn.
    """
    if mode == "named" and named is not None:
        return json.dumps(tool_call_for(prompt_text, named).arguments, ensure_ascii=False)
    if mode == "required" and tools:
        reply = plan_reply(prompt_text)
        if not isinstance(reply, ToolCallReply):
            first = tools[0].get("function", {}).get("name", "") if isinstance(tools[0], dict) else ""
            reply = tool_call_for(prompt_text, first)
        return json.dumps([{"name": reply.name, "parameters": reply.arguments}], ensure_ascii=False)
    return plan_reply(prompt_text).text


def finish_reason(parsed: ParsedOutput, mode: ToolMode, sampled_reason: str) -> str:
    # OpenAI: "tool_calls" for auto and required tool calls, "stop" for a named tool choice.
    if mode == "auto" and parsed.tools_called:
        return "tool_calls"
    if mode == "required" and parsed.tools_called and sampled_reason == "stop":
        return "tool_calls"
    return sampled_reason


def stream_finish_reason(tools_streamed: bool, mode: ToolMode, sampled_reason: str) -> str:
    # vLLM's streaming rule: any streamed tool call turns "stop" into "tool_calls", unless named.
    if tools_streamed and mode != "named" and sampled_reason == "stop":
        return "tool_calls"
    return sampled_reason
