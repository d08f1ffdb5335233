"""Shadow capture: what clients sent and what the backend answered, one JSON line per request.

Opt-in (``capture: {path: FILE}``, env ``PREFIX_PROXY_CAPTURE__PATH``) because the lines hold
prompt text: the file is created with mode 0600 (and an existing one is narrowed to it), and
rotated by size (FILE -> FILE.1 -> ... -> FILE.<backups>, the oldest dropped). ``prefix-proxy
analyze FILE`` replays it (``proxy.analysis``).

A line is written when the answer is complete, in a single ``write`` to a file opened for
appending, so lines of concurrent requests never interleave; ``seq`` is the arrival order,
which the replay follows. Writes are synchronous: a line is a few kilobytes into the page
cache, and a failing disk never fails a request (the capture stops, once, with a warning).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

from proxy.config import CaptureSettings
from proxy.openai import Usage, dumps

FORMAT_VERSION = 1
FILE_MODE = 0o600

logger = logging.getLogger("prefix_proxy.capture")


class CaptureWriter:
    def __init__(self, path: str | Path, max_bytes: int = 256 * 1024 * 1024, backups: int = 3) -> None:
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self.backups = backups
        self._sequence = itertools.count(1)
        self._fd: int | None = None
        self._size = 0
        self._failed = False
        self._open()

    @classmethod
    def from_settings(cls, settings: CaptureSettings) -> CaptureWriter | None:
        if not settings.path:
            return None
        return cls(settings.path, settings.max_bytes, settings.backups)

    def next_seq(self) -> int:
        """The arrival number of a request (taken when it arrives, written when it is answered)."""
        return next(self._sequence)

    def write(self, record: dict[str, Any]) -> None:
        if self._failed:
            return
        line = dumps(record) + b"\n"
        try:
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            assert self._fd is not None
            os.write(self._fd, line)
            self._size += len(line)
        except OSError as error:
            self._failed = True
            logger.warning("capture stopped: cannot write %s (%s)", self.path, error.strerror or error)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        # An existing file keeps its mode on open: narrow it, it is about to hold prompts.
        os.fchmod(self._fd, FILE_MODE)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        self.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for index in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._open()


def capture_record(
    seq: int,
    arrived: float,
    tenant: str,
    session: str | None,
    body: dict[str, Any],
    usage: Usage | None,
    reply: dict[str, Any] | None,
    *,
    backend: str | None = None,
    status: int = 200,
) -> dict[str, Any]:
    """One line: the client's request as received (before any rewrite) and the backend's answer."""
    return {
        "v": FORMAT_VERSION,
        "seq": seq,
        "ts": round(arrived, 3),
        "tenant": tenant,
        "session": session,
        "backend": backend,
        "request": body,
        "response": {
            "status": status,
            "usage": None
            if usage is None
            else {
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
            },
            "message": reply,
        },
    }


def arrival() -> float:
    return time.time()
