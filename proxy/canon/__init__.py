"""Canonicalization: rewrite requests into stable prefixes without changing what the model is told."""

from proxy.canon.actions import Action
from proxy.canon.canonicalizer import Canonicalizer, PrefixTracker
from proxy.canon.engine import CanonOptions, CanonResult, canonicalize
from proxy.canon.fingerprint import leading_system_count, stable_prefix_hash
from proxy.canon.layout import Block, ForwardedLayouts
from proxy.canon.learned import LearnedVolatility, PromptLines
from proxy.canon.toolcalls import GeneratedCall, ToolCallMemory, remember_generated_calls
from proxy.canon.tools import ToolOrders, canonicalize_tool_fields
from proxy.canon.tools import expire_idle as expire_idle_tool_forms
from proxy.canon.units import Units, units_of
from proxy.canon.varying import _VARIED, Place, VaryingPlaces

__all__ = [
    "_VARIED",
    "Action",
    "Block",
    "CanonOptions",
    "CanonResult",
    "Canonicalizer",
    "ForwardedLayouts",
    "GeneratedCall",
    "LearnedVolatility",
    "Place",
    "PrefixTracker",
    "PromptLines",
    "ToolCallMemory",
    "ToolOrders",
    "Units",
    "VaryingPlaces",
    "canonicalize",
    "canonicalize_tool_fields",
    "expire_idle_tool_forms",
    "leading_system_count",
    "remember_generated_calls",
    "stable_prefix_hash",
    "units_of",
]
