"""A vLLM stand-in whose prefix-cache accounting follows vLLM's automatic prefix caching.

Used by the proxy's tests, the benchmarks and ``prefix-proxy demo``: cache-hit numbers
measured against it predict what a real vLLM serving a Qwen2.5-style model reports.
"""

from proxy.enginemodel import (
    QWEN_STYLE_CHAT_TEMPLATE,
    ChatTokenizer,
    HFTokenizer,
    PrefixCache,
    PrefixCacheStats,
    RequestBlocks,
    TiktokenChatTokenizer,
    block_hashes,
    load_tokenizer,
    render_chat,
)
from testbed.fakevllm.app import create_app
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.replies import plan_reply, reply_for_prompt
from testbed.fakevllm.server import serve

__all__ = [
    "QWEN_STYLE_CHAT_TEMPLATE",
    "ChatTokenizer",
    "FakeBackendConfig",
    "HFTokenizer",
    "PrefixCache",
    "PrefixCacheStats",
    "RequestBlocks",
    "TiktokenChatTokenizer",
    "block_hashes",
    "create_app",
    "load_tokenizer",
    "plan_reply",
    "render_chat",
    "reply_for_prompt",
    "serve",
]
