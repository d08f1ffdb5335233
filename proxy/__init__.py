"""prefix-proxy: an OpenAI-compatible proxy that makes vLLM's prefix cache hit."""

__version__ = "0.1.0"
