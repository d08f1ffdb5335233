"""A model of what vLLM does with a chat request before it computes it, offline and pure.

* ``chat_template``: the prompt text vLLM renders for a request (its message and tool
  preprocessing, then the Qwen2.5 / ChatML template), byte for byte.
* ``tokenizer``: the token ids of that text (bundled cl100k + ChatML markers, or a Hugging Face
  ``tokenizer.json``).
* ``prefix_cache``: vLLM's automatic prefix cache over those ids (chained block hashes, LRU
  eviction, ``cached_tokens``).

``prefix-proxy analyze`` replays captured traffic through it; the fake vLLM of ``testbed.fakevllm``
is built on it (the dependency goes that way only: nothing here imports ``testbed``).
"""

from proxy.enginemodel.chat_template import QWEN_STYLE_CHAT_TEMPLATE, ChatTemplateError, render_chat
from proxy.enginemodel.prefix_cache import PrefixCache, PrefixCacheStats, RequestBlocks, block_hashes
from proxy.enginemodel.tokenizer import ChatTokenizer, HFTokenizer, TiktokenChatTokenizer, load_tokenizer

__all__ = [
    "QWEN_STYLE_CHAT_TEMPLATE",
    "ChatTemplateError",
    "ChatTokenizer",
    "HFTokenizer",
    "PrefixCache",
    "PrefixCacheStats",
    "RequestBlocks",
    "TiktokenChatTokenizer",
    "block_hashes",
    "load_tokenizer",
    "render_chat",
]
