"""Read a rendered ChatML prompt back into turns.

The reply policy works on prompt *text*, because it is reused inside a vLLM logits processor
that only sees the decoded prompt. This module recovers what the policy needs from the text
the Qwen-style template produces: the turns, the tools declared in the system block, and
whether the final user turn is a batch of tool responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOLS_OPEN = "<tools>\n"
TOOLS_CLOSE = "\n</tools>"
TOOL_RESPONSE_OPEN = "<tool_response>"


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    closed: bool  # False for a trailing turn without <|im_end|> (the generation prompt)

    @property
    def is_tool_responses(self) -> bool:
        # The template groups tool results into a user turn made only of <tool_response> blocks.
        return self.role == "user" and self.content.startswith(TOOL_RESPONSE_OPEN)


@dataclass(frozen=True)
class PromptView:
    turns: tuple[Turn, ...]
    tools: tuple[dict[str, Any], ...]

    @property
    def last_turn(self) -> Turn | None:
        """The turn the reply answers: the last one with content, skipping an empty open prompt."""
        for turn in reversed(self.turns):
            if turn.closed or turn.content:
                return turn
        return None

    @property
    def history(self) -> tuple[Turn, ...]:
        """Closed turns before ``last_turn``."""
        last = self.last_turn
        if last is None:
            return ()
        index = max(i for i, turn in enumerate(self.turns) if turn is last)
        return self.turns[:index]


def parse_prompt(prompt_text: str) -> PromptView:
    """Split a ChatML prompt; text without ChatML markers is one user turn."""
    if IM_START not in prompt_text:
        return PromptView(turns=(Turn("user", prompt_text, closed=True),), tools=())
    turns: list[Turn] = []
    for segment in prompt_text.split(IM_START)[1:]:
        role, _, rest = segment.partition("\n")
        end = rest.find(IM_END)
        if end >= 0:
            turns.append(Turn(role.strip(), rest[:end], closed=True))
        else:
            turns.append(Turn(role.strip(), rest, closed=False))
    tools: tuple[dict[str, Any], ...] = ()
    if turns and turns[0].role == "system":
        tools = declared_tools(turns[0].content)
    return PromptView(turns=tuple(turns), tools=tools)


def declared_tools(system_text: str) -> tuple[dict[str, Any], ...]:
    """Tool definitions between <tools> and </tools>, one JSON object per line."""
    start = system_text.find(TOOLS_OPEN)
    if start < 0:
        return ()
    end = system_text.find(TOOLS_CLOSE, start)
    block = system_text[start + len(TOOLS_OPEN) : end if end >= 0 else len(system_text)]
    tools: list[dict[str, Any]] = []
    for line in block.split("\n"):
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(tool, dict):
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                tools.append(function)
    return tuple(tools)
