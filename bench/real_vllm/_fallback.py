"""Stand-ins used until the fake backend's own modules exist.

`proxy.fakebackend.template.QWEN_STYLE_CHAT_TEMPLATE` and
`proxy.fakebackend.replies.reply_for_prompt` are the real sources; `hooks.py` prefers them and
falls back to these only when those modules are absent. No third-party imports here: this file
is imported by the vLLM server process and by the model build script.
"""

from __future__ import annotations

import hashlib
import json
import re

# Qwen2.5-Instruct's chat template (tools rendered in the system turn, <tool_call> replies,
# consecutive tool results grouped in one user turn), kept byte-compatible with the original.
QWEN25_CHAT_TEMPLATE = (
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
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
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
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
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

_TOOL_NAME = re.compile(r'^\{"type": "function", "function": \{"name": "([^"]+)"', re.MULTILINE)
_LAST_TURN = re.compile(r"<\|im_start\|>(user|assistant|system)\n?(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def reply_for_prompt(prompt_text: str, max_tokens: int | None) -> str:
    """Placeholder: a deterministic reply derived from the rendered prompt.

    With tools declared and the last turn not a tool result: one `<tool_call>` to the first tool.
    Otherwise a short text naming a digest of the prompt.
    """
    digest = hashlib.sha256(prompt_text.encode("utf-8")).hexdigest()[:12]
    head, _, _ = prompt_text.rpartition("<|im_start|>assistant")
    turns = _LAST_TURN.findall(head)
    last_role, last_content = turns[-1] if turns else ("user", "")
    tools = _TOOL_NAME.findall(head)
    if tools and "<tool_response>" not in last_content:
        args = {"query": last_content.strip()[:40], "ref": digest[:8]}
        return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (
            tools[0],
            json.dumps(args, ensure_ascii=False),
        )
    words = ["Answer", digest, "for", last_role + ":"] + last_content.split()[:12]
    text = " ".join(words)
    if max_tokens is not None:
        text = " ".join(text.split()[: max(1, max_tokens // 3)])
    return text
