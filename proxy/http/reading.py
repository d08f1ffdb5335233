"""One reading: a request's generation controls read as the engine reads them.

vLLM parses a request body into pydantic models (lax mode): ``"n": "8"``, ``"n": 8.0`` and
``"n": true`` are the integers 8, 8 and 1 to it; ``"stream": "false"`` is ``False``; ``"n": 8.5`` is
a 400. A proxy that budgets on one reading (a string is not a number: one completion) and forwards
bytes the engine reads another way (eight) spends what it never admitted. So the fields that decide
admission, budgets, routing and the stream are read here once, with pydantic and the types of vLLM's
own request models, and written back into the body as the values read: what goes upstream is
serialized from the values the proxy decided on, so the two readings cannot differ. A value pydantic
refuses is a 400 naming the parameter, as vLLM answers it.

Only these fields are read: everything else in the body is the engine's to judge, untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from proxy.http.errors import InvalidRequest

_INT = TypeAdapter(int | None)
_BOOL = TypeAdapter(bool | None)
_STR = TypeAdapter(str | None)
_KINDS: dict[type, tuple[TypeAdapter[Any], type]] = {int: (_INT, int), bool: (_BOOL, bool), str: (_STR, str)}


class EngineReading:
    """The typed fields of one protocol's request, read as vLLM's request model reads them."""

    def __init__(self, protocol: str, fields: Mapping[str, type]) -> None:
        self.protocol = protocol
        self._fields = [(name, *_KINDS[kind]) for name, kind in fields.items()]

    def read(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its fields replaced by the values the engine reads (in place; returned);
        :class:`InvalidRequest` where the engine would refuse the value."""
        for name, adapter, kind in self._fields:
            value = body.get(name)
            if value is None or type(value) is kind:
                continue  # the common case: already the value the engine reads
            try:
                body[name] = adapter.validate_python(value)
            except ValidationError as error:
                reason = error.errors()[0].get("msg", "invalid value")
                raise InvalidRequest(f"'{name}': {reason}", param=name) from None
        return body


# vLLM 0.32's request models (vllm/entrypoints/openai/protocol.py and the Anthropic and Responses
# ones): the fields the proxy decides on, with the types declared there.
CHAT = EngineReading(
    "chat",
    {
        "model": str,
        "n": int,
        "best_of": int,
        "max_tokens": int,
        "max_completion_tokens": int,
        "stream": bool,
    },
)
COMPLETIONS = EngineReading(
    "completions", {"model": str, "n": int, "best_of": int, "max_tokens": int, "stream": bool, "echo": bool}
)
RESPONSES = EngineReading(
    "responses", {"model": str, "max_output_tokens": int, "stream": bool, "store": bool, "background": bool}
)
MESSAGES = EngineReading("messages", {"model": str, "max_tokens": int, "stream": bool})
