"""Offline BPE tokenization and cached per-message token counting."""

from proxy.tokenization.counter import TokenCounter
from proxy.tokenization.encoding import load_encoding

__all__ = ["TokenCounter", "load_encoding"]
