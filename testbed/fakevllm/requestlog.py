"""What the fake backend saw, kept for tests: a bounded request log and stream counters."""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the backend received and handled it."""

    request_id: str
    endpoint: str
    body: Any
    headers: dict[str, str]
    stream: bool = False
    model: str | None = None
    status_code: int = 200
    # "running", "completed", "cancelled" (client went away), "aborted" (fake_options), "error"
    state: str = "running"
    error: str | None = None
    prompt_text: str = ""
    prompt_token_ids: array[int] = field(default_factory=lambda: array("l"))
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    output_text: str = ""
    received_at: float = field(default_factory=time.time)
    ttft_s: float | None = None

    def to_json(self, include_token_ids: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "stream": self.stream,
            "status_code": self.status_code,
            "state": self.state,
            "error": self.error,
            "prompt_tokens": len(self.prompt_token_ids),
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "prompt_text": self.prompt_text,
            "output_text": self.output_text,
            "received_at": self.received_at,
            "ttft_s": self.ttft_s,
            "headers": self.headers,
            "body": self.body,
        }
        if include_token_ids:
            data["prompt_token_ids"] = self.prompt_token_ids.tolist()
        return data


class RequestLog:
    """The last ``max_entries`` requests, oldest first."""

    def __init__(self, max_entries: int = 256) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=max_entries)

    def add(self, record: RequestRecord) -> RequestRecord:
        self._records.append(record)
        return record

    def last(self, limit: int | None = None) -> list[RequestRecord]:
        records = list(self._records)
        return records if limit is None else records[-limit:] if limit > 0 else []

    def clear(self) -> None:
        self._records.clear()


@dataclass
class StreamStats:
    """Proof of what happened to SSE streams (e.g. that a client disconnect closed one)."""

    active_streams: int = 0
    streams_completed: int = 0
    streams_cancelled: int = 0
    streams_aborted: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "active_streams": self.active_streams,
            "streams_completed": self.streams_completed,
            "streams_cancelled": self.streams_cancelled,
            "streams_aborted": self.streams_aborted,
        }
