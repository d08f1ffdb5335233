"""Offline BPE tokenization and cached per-message token counting."""

from proxy.tokenization.encoding import load_encoding
from proxy.tokenization.counter import TokenCounter

__all__ = ["TokenCounter", "load_encoding"]
