"""Identifiers the proxy mints (request and session ids)."""

from __future__ import annotations

import itertools
import os

_PROCESS_ID = os.urandom(8).hex()
_SEQUENCE = itertools.count(1)


def unique_id() -> str:
    """32 hex digits, unique across replicas and restarts: a random per-process half and a counter.

    For ids that need uniqueness, not unpredictability (a session id grants nothing: sessions are
    keyed by tenant, and ids a client names are hashed); a tenth of what ``uuid4()`` costs.
    """
    return f"{_PROCESS_ID}{next(_SEQUENCE):016x}"
