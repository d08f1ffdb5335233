"""Progress of a command that sends many requests (``prefix-proxy ramp``, ``prefix-proxy demo``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class ProgressBar:
    """A one-line progress bar on a terminal; on anything else, one line per finished phase."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._label = ""
        self._started = 0.0
        self._last_draw = 0.0

    def start(self, label: str) -> Callable[[int, int], None]:
        self._label = label
        self._started = time.monotonic()
        self._last_draw = 0.0
        return self.update

    def update(self, done: int, total: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.05:
            return
        self._last_draw = now
        total = max(total, 1)
        filled = min(self.width, self.width * done // total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self._label:<8} [{bar}] {done}/{total} requests {now - self._started:5.1f}s")
        self.stream.flush()

    def finish(self, done: int) -> None:
        elapsed = time.monotonic() - self._started
        line = f"{self._label:<8} {done} requests in {elapsed:.1f}s"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width + 40) + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
