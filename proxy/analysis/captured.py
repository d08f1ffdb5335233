"""Reading a capture file (``proxy.observability.capture``): the requests in arrival order."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Captured:
    seq: int
    tenant: str
    session: str | None
    body: dict[str, Any]
    reply: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int


def read_capture(paths: Iterable[str | Path]) -> list[Captured]:
    """Every well-formed line of the files (rotated parts included), sorted by arrival.

    A line that is not a capture record (a torn last line after a crash) is skipped.
    """
    records = [record for path in paths for record in _lines(Path(path))]
    records.sort(key=lambda r: r.seq)
    return records


def _lines(path: Path) -> Iterator[Captured]:
    with path.open("rb") as file:
        for raw in file:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            record = _record(line)
            if record is not None:
                yield record


def _record(line: Any) -> Captured | None:
    if not isinstance(line, dict):
        return None
    body = line.get("request")
    response = line.get("response")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not isinstance(response, dict):
        return None
    usage = response.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    reply = response.get("message")
    return Captured(
        seq=int(line.get("seq") or 0),
        tenant=str(line.get("tenant") or "anonymous"),
        session=line.get("session") if isinstance(line.get("session"), str) else None,
        body=body,
        reply=reply if isinstance(reply, dict) else None,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(usage.get("cached_tokens") or 0),
    )
