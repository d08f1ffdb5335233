"""Redis Cluster hash tags: which keys must share a hash slot.

A Lua script or a MULTI/EXEC on a Redis Cluster may only touch keys of one slot. Redis hashes only
the part of a key between the first ``{`` and the next ``}`` when there is one, so keys that carry
the same tag land in the same slot. The budget keys of one admission (the tenant's counter and the
session's) carry the tenant's tag: admission checks and reserves them in one atomic script.
"""

from __future__ import annotations

import hashlib


def slot_tag(scope: str) -> str:
    """``{scope}``, or ``{<digest>}`` when ``scope`` is empty or holds a brace (which would end or
    split the tag): keys built with the same scope always share a slot, on one server harmlessly."""
    if scope and "{" not in scope and "}" not in scope:
        return f"{{{scope}}}"
    return "{" + hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest() + "}"
