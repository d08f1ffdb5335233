"""The floor of captured traffic: per app, the tokens no arrangement of its prompts can avoid.

A request's floor is the tokens of its lines that no earlier request of its app carried, the
model's replies counted as seen (:class:`~proxy.observability.FloorMeter`, the operator page's and
the bench's own measure). It belongs to the requests as the client sent them, so it is measured
once, whatever the canonicalization mode; each mode's prefill is then read as a multiple of it.

The meter reports the new lines' bytes, not the lines: their tokens are the bytes at the
request's own tokens per byte, the tokens counted by the engine model's tokenizer on the prompt
as sent (rendered with its chat template). An estimate, said so in the report: the template's
markers raise the rate a little, so the floor errs high, as the meter's bounded memory makes it.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.analysis.captured import Captured
from proxy.analysis.replay import AppOf, app_of
from proxy.enginemodel import ChatTemplateError, ChatTokenizer, render_chat
from proxy.observability import Floor, FloorMeter

# Line hashes each app remembers: offline there is room, and a forgotten line counts again.
FLOOR_LINES = 1 << 20
FLOOR_MEASURE = (
    "tokens estimated: the new lines' bytes at each request's tokens per byte "
    "(the engine model's tokenizer on the prompt as sent)"
)


@dataclass
class FloorTally:
    requests: int = 0
    tokens: int = 0
    new_bytes: int = 0
    new_lines: int = 0

    def add(self, floor: Floor, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens
        self.new_bytes += floor.new_bytes
        self.new_lines += floor.new_lines

    def times(self, prefill_tokens: int) -> float | None:
        """``prefill_tokens`` as a multiple of this floor (1.0: nothing left to win); None without one."""
        return round(prefill_tokens / self.tokens, 2) if self.tokens else None

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "floor_tokens": self.tokens,
            "new_bytes": self.new_bytes,
            "new_lines": self.new_lines,
        }


@dataclass
class FloorResult:
    total: FloorTally = field(default_factory=FloorTally)
    apps: dict[str, FloorTally] = field(default_factory=dict)
    # Requests the chat template cannot render: the replay skips them in every mode, so does the floor.
    skipped: int = 0


def measure_floors(records: Iterable[Captured], tokenizer: ChatTokenizer, *, app: AppOf = app_of) -> FloorResult:
    meters: dict[str, FloorMeter] = {}
    result = FloorResult()
    for record in records:
        messages: list[Any] = record.body["messages"]  # a list: read_capture keeps no other record
        tools: list[Any] | None = record.body.get("tools") if isinstance(record.body.get("tools"), list) else None
        try:
            prompt_tokens = len(tokenizer.encode(render_chat(messages, tools)))
        except (ChatTemplateError, KeyError, TypeError, AttributeError):
            result.skipped += 1
            continue
        name = app(record)
        meter = meters.get(name)
        if meter is None:
            meter = meters[name] = FloorMeter(FLOOR_LINES)
        floor = meter.measure(messages, tools or ())
        meter.saw_reply(record.reply)
        tokens = floor.tokens(prompt_tokens)
        result.total.add(floor, tokens)
        result.apps.setdefault(name, FloorTally()).add(floor, tokens)
    return result
