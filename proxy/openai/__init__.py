"""The OpenAI chat protocol's data: messages, usage, the assistant's reply, JSON as the wire has it.

A leaf: it imports nothing else from the proxy, so every part (and ``summarizer``) may import it.
"""

from proxy.openai.assistant import AssistantRecorder, ToolCall
from proxy.openai.continuation import Continuations, Resumption, shared_length
from proxy.openai.jsoncanon import canonical_arguments, canonical_dumps, sort_keys_deep
from proxy.openai.jsonio import (
    MAX_DEPTH,
    TooDeep,
    check_depth,
    check_depth_once,
    dumps,
    loads,
    shared_dumps,
    shared_json,
)
from proxy.openai.jsonio import (
    expire_idle as expire_idle_lists,
)
from proxy.openai.memo import ARGUMENTS_MEMO_CHARS, TextMemo, memo_by_text
from proxy.openai.messages import (
    LONG_TEXT_CHARS,
    ONE_SHOT_BYTES,
    STABLE_ROLES,
    extend_links,
    is_text_parts,
    leading_system_count,
    link_hash,
    message_fingerprint,
    message_text,
    role_prefix,
    utf8_size,
)
from proxy.openai.recurring import ByText, reuse_texts, same_text
from proxy.openai.resumedjson import dumps_body, resumed_loads
from proxy.openai.usage import Usage, token_count

__all__ = [
    "ARGUMENTS_MEMO_CHARS",
    "LONG_TEXT_CHARS",
    "MAX_DEPTH",
    "ONE_SHOT_BYTES",
    "STABLE_ROLES",
    "AssistantRecorder",
    "ByText",
    "Continuations",
    "Resumption",
    "TextMemo",
    "TooDeep",
    "ToolCall",
    "Usage",
    "canonical_arguments",
    "canonical_dumps",
    "check_depth",
    "check_depth_once",
    "dumps",
    "dumps_body",
    "expire_idle_lists",
    "extend_links",
    "is_text_parts",
    "leading_system_count",
    "link_hash",
    "loads",
    "memo_by_text",
    "message_fingerprint",
    "message_text",
    "resumed_loads",
    "reuse_texts",
    "role_prefix",
    "same_text",
    "shared_dumps",
    "shared_json",
    "shared_length",
    "sort_keys_deep",
    "token_count",
    "utf8_size",
]
