"""The explainable record of what canonicalization did to one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Action:
    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.detail}" if self.detail else self.kind
