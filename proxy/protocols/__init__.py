"""The generation protocols vLLM serves (chat completions, Anthropic Messages, Responses), one
class each (``base.GenerationProtocol``), mapped onto the chat pipeline.

Each protocol converts its request into the chat shape the pipeline canonicalizes
(a *view*), and maps the canonical view back onto the client's own body, so what the backend
receives stays in the client's protocol and byte-identical wherever nothing changed.
"""

from proxy.protocols.anthropic import MESSAGES
from proxy.protocols.base import Diagnosis, DiagnosticsAsk, GenerationProtocol, ProtocolView
from proxy.protocols.channel import CHAT, SummaryChannel
from proxy.protocols.chat import CHAT_COMPLETIONS, with_upstream_usage
from proxy.protocols.responses import RESPONSES

__all__ = [
    "CHAT",
    "CHAT_COMPLETIONS",
    "MESSAGES",
    "RESPONSES",
    "Diagnosis",
    "DiagnosticsAsk",
    "GenerationProtocol",
    "ProtocolView",
    "SummaryChannel",
    "with_upstream_usage",
]
