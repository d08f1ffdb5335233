"""Compaction of old conversation turns into a stable, cache-friendly summary.

- :mod:`summarizer.policy`: when to compact and which turns to fold (pure);
- :mod:`summarizer.anchor`: placing the summary and dropping what it covers (pure);
- :mod:`summarizer.prompt`: the summarization request (pure);
- :mod:`summarizer.compactor`: asking the backend for the summary (injected I/O);
- :mod:`summarizer.state`: the stored summary state.
"""

from summarizer.anchor import SUMMARY_HEADER, Anchored, Known, anchor, summary_message
from summarizer.compactor import Compaction, CompactionFailed, Compactor, CompactorOptions, client_messages
from summarizer.policy import SummaryPolicy, is_due, kept_when_used, needed_soon, plan_chunk, requests_until_used
from summarizer.prompt import DEFAULT_INSTRUCTION, RENDERING_FIELDS, build_request
from summarizer.state import SummaryState

__all__ = [
    "DEFAULT_INSTRUCTION",
    "RENDERING_FIELDS",
    "SUMMARY_HEADER",
    "Anchored",
    "Compaction",
    "CompactionFailed",
    "Compactor",
    "CompactorOptions",
    "Known",
    "SummaryPolicy",
    "SummaryState",
    "anchor",
    "build_request",
    "client_messages",
    "is_due",
    "kept_when_used",
    "needed_soon",
    "plan_chunk",
    "requests_until_used",
    "summary_message",
]
