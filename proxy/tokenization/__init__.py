"""Offline BPE tokenization and cached per-message token counting."""

from proxy.tokenization.counter import CAUTIOUS_TOKENS_PER_BYTE, TYPICAL_TOKENS_PER_BYTE, TokenCounter
from proxy.tokenization.encoding import load_encoding

__all__ = ["CAUTIOUS_TOKENS_PER_BYTE", "TYPICAL_TOKENS_PER_BYTE", "TokenCounter", "load_encoding"]
