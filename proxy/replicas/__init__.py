"""What one proxy replica learns, shared with the others through the session store.

The canonicalizer's memories (learned volatile lines, places seen to vary, forwarded layouts, the
tool calls it relayed, models with strict chat templates) live in each process. Behind a
round-robin load balancer every replica would learn them alone, and a conversation's next turn
would land on a replica that never saw where its lines went. Here each memory journals what it
learns (``memories``), the journal is written behind to a bounded Redis stream, and every replica
applies what the others wrote as it arrives (``feed``). The request path never waits for Redis.
"""

from proxy.replicas.build import build_shared
from proxy.replicas.feed import RedisFeed
from proxy.replicas.memories import Journal, SharedCanonicalizer

__all__ = ["Journal", "RedisFeed", "SharedCanonicalizer", "build_shared"]
