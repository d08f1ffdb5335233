"""Canonicalization: rewrite requests into stable prefixes without changing what the model is told."""

from proxy.canon.actions import Action
from proxy.canon.engine import CanonOptions, CanonResult, canonicalize
from proxy.canon.learned import LearnedVolatility
from proxy.canon.toolcalls import ToolCallMemory, remember_generated_calls

__all__ = [
    "Action",
    "CanonOptions",
    "CanonResult",
    "LearnedVolatility",
    "ToolCallMemory",
    "canonicalize",
    "remember_generated_calls",
]
