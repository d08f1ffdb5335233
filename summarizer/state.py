"""What a session's summary is: the text, the messages it stands for, and the repair tail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SummaryState:
    text: str = ""
    # message_fingerprint of every message the summary stands for.
    covered: set[int] = field(default_factory=set)
    tokens: int = 0
    version: int = 0
    updated: float = 0.0
    # Sliding-window repair: the uncovered history as last forwarded (canonical messages), and the
    # stable prefix (system prompt, tools) it was forwarded after: it repairs only that app's requests.
    tail: list[dict[str, Any]] = field(default_factory=list)
    tail_prefix: str = ""

    @property
    def active(self) -> bool:
        return bool(self.text)

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "covered": sorted(self.covered),
            "tokens": self.tokens,
            "version": self.version,
            "updated": self.updated,
            "tail": self.tail,
            "tail_prefix": self.tail_prefix,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SummaryState:
        if not data:
            return cls()
        return cls(
            text=str(data.get("text", "")),
            covered={int(fp) for fp in data.get("covered", [])},
            tokens=int(data.get("tokens", 0)),
            version=int(data.get("version", 0)),
            updated=float(data.get("updated", 0.0)),
            tail=list(data.get("tail", [])),
            tail_prefix=str(data.get("tail_prefix", "")),
        )
