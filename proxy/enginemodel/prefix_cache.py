"""A model of vLLM v1 automatic prefix caching (APC), block for block.

Mirrors ``vllm/v1/core/{kv_cache_manager,block_pool,kv_cache_utils}.py``:

* The KV pool holds ``capacity_blocks`` blocks of ``block_size`` token slots. A block is
  *cached* once it is full: its hash chains the parent block's hash, the block's token ids
  and the extra keys (the request's ``cache_salt``, first block only). One changed token in
  block k therefore changes the hash of k and of every later block.
* A new request reuses the longest run of leading blocks whose hashes are cached, capped at
  ``num_prompt_tokens - 1`` tokens: the last prompt token is always recomputed to get logits,
  which with a fully cached, block-aligned prompt means recomputing its whole last block.
  Only full blocks ever hit.
* Hit blocks are "touched" (ref count + 1, removed from the free queue); the rest of the
  prompt gets blocks popped from the head of the free queue, evicting whatever cached hash a
  popped block carried (LRU). Blocks never used yet are handed out first, as vLLM's initial
  free queue is every block in id order.
* Full prompt blocks are cached as soon as the request is admitted. Generated tokens are
  cached too: at the end, every full block of ``prompt + output[:-1]`` is hashed and
  cached; the final sampled token is never fed back through the model, so its KV does not
  exist. Identical blocks computed twice are both kept (vLLM never de-duplicates).
* A finished request frees its blocks to the free-queue tail in reverse order, so its last
  (least shareable) block is evicted first; blocks another request still uses stay put.
* ``stats`` counts like ``vllm:prefix_cache_queries_total`` / ``_hits_total``: queries add the
  prompt length of every admitted request, hits add its cached tokens.
* ``usage`` is ``vllm:kv_cache_usage_perc``: the fraction of blocks held by running
  requests. Cached-but-free blocks count as free, so an idle server reports 0.0.

Deliberate simplifications: blocks for generated tokens are allocated when the request ends
(vLLM allocates them step by step, so under memory pressure it may evict a little earlier),
and there is no preemption: ``admit`` returns ``None`` when the free blocks cannot hold the
prompt, and the caller waits, as vLLM's scheduler keeps such a request waiting.

Pure: no I/O, no clock, no randomness; callers serialize access.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

BlockHash = bytes

# Parent of the first block. vLLM seeds this randomly per process; any constant models it.
NONE_HASH: BlockHash = b"\x00" * 16


def hash_block_tokens(
    parent: BlockHash | None, block_token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """hash(parent hash, block token ids, extra keys), as 16 bytes of xxh3-128."""
    hasher = xxhash.xxh3_128(parent if parent is not None else NONE_HASH)
    hasher.update(array("q", block_token_ids).tobytes())
    for key in extra_keys:
        raw = key.encode("utf-8", "surrogatepass")
        # Length-prefixed so ("ab",) and ("a", "b") cannot collide.
        hasher.update(len(raw).to_bytes(8, "little") + raw)
    return hasher.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    *,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``start_block``/``parent`` continue an existing chain: block ``start_block`` of the
    sequence is hashed with ``parent`` as its parent.
    """
    hashes: list[BlockHash] = []
    for index in range(start_block, len(token_ids) // block_size):
        start = index * block_size
        extra = (cache_salt,) if index == 0 and cache_salt else ()
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens (``requests`` counts admitted requests)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class RequestBlocks:
    """The KV blocks one admitted request holds, until ``PrefixCache.finish``."""

    prompt_token_ids: list[int]
    cache_salt: str | None
    num_cached_tokens: int
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PrefixCache:
    """The block pool, cached-hash index and LRU free queue of one vLLM engine."""

    def __init__(self, block_size: int = 16, capacity_blocks: int = 65536, enable_caching: bool = True) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be positive")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        self._ref_cnt = [0] * capacity_blocks
        self._hash: list[BlockHash | None] = [None] * capacity_blocks
        # Blocks at index >= _next_fresh were never handed out; they precede the free queue.
        self._next_fresh = 0
        # Released blocks in eviction order: first = least recently freed = next victim.
        self._free: OrderedDict[int, None] = OrderedDict()
        # hash -> ids of blocks holding it, first inserted first (what a lookup returns).
        self._cached: dict[BlockHash, dict[int, None]] = {}

    # -- introspection -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.capacity_blocks - self._next_fresh + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash (running or evictable), duplicates included."""
        return sum(len(ids) for ids in self._cached.values())

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (``vllm:kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.capacity_blocks

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens a request with this prompt would get from the cache now.

        Read-only: no stats, no LRU touch, so a probe does not change what it measures.
        """
        hit = self._find_hit(block_hashes(token_ids, self.block_size, cache_salt), len(token_ids))
        return len(hit) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a prompt of ``num_tokens`` occupies while it runs."""
        return _cdiv(num_tokens, self.block_size)

    # -- request lifecycle -----------------------------------------------------------------

    def admit(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> RequestBlocks | None:
        """Look up, touch and allocate blocks for a new request; ``None`` if they do not fit now."""
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise ValueError("a request needs at least one prompt token")
        needed = self.blocks_needed(num_tokens)
        if needed > self.capacity_blocks:
            raise ValueError(f"prompt needs {needed} KV blocks, the cache has {self.capacity_blocks}")
        hashes = block_hashes(prompt_token_ids, self.block_size, cache_salt)
        hit = self._find_hit(hashes, num_tokens)
        num_new = self.blocks_needed(num_tokens) - len(hit)
        # Touching a free hit block takes it off the free queue, so it must be counted too.
        evictable_hits = sum(1 for block in hit if self._ref_cnt[block] == 0)
        if num_new + evictable_hits > self.num_free_blocks:
            return None

        for block in hit:
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1
        request = RequestBlocks(
            prompt_token_ids=list(prompt_token_ids),
            cache_salt=cache_salt,
            num_cached_tokens=len(hit) * self.block_size,
            block_ids=hit + [self._allocate() for _ in range(num_new)],
            block_hashes=hashes,
        )
        for index in range(len(hit), len(hashes)):
            self._register(request.block_ids[index], hashes[index])
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += num_tokens
            self.stats.hits += request.num_cached_tokens
        return request

    def finish(self, request: RequestBlocks, output_token_ids: Sequence[int]) -> None:
        """Cache the full blocks of prompt + computed outputs, then release the request's blocks.

        ``output_token_ids`` are all tokens sampled for the request (for an aborted stream:
        those sampled so far). The last one was never computed, so it is not cached.
        """
        if request.finished:
            return
        request.finished = True
        computed = request.prompt_token_ids + list(output_token_ids[:-1])
        num_slots_needed = len(computed)
        while len(request.block_ids) * self.block_size < num_slots_needed:
            if self.num_free_blocks == 0:
                break  # vLLM would preempt; the model simply stops caching here
            request.block_ids.append(self._allocate())
        num_full = min(num_slots_needed, len(request.block_ids) * self.block_size) // self.block_size
        first_new = len(request.block_hashes)
        if num_full > first_new:
            request.block_hashes += block_hashes(
                computed[: num_full * self.block_size],
                self.block_size,
                request.cache_salt,
                parent=request.block_hashes[-1] if request.block_hashes else None,
                start_block=first_new,
            )
            for index in range(first_new, num_full):
                self._register(request.block_ids[index], request.block_hashes[index])
        for block in reversed(request.block_ids):
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                self._free[block] = None

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every cached hash; refused while blocks are in use."""
        if self.num_used_blocks:
            return False
        for block_ids in self._cached.values():
            for block in block_ids:
                self._hash[block] = None
        self._cached.clear()
        return True

    # -- internals ---------------------------------------------------------------------------

    def _find_hit(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        if not self.enable_caching or num_tokens == 0:
            return []
        max_blocks = (num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            holders = self._cached.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def _allocate(self) -> int:
        if self._next_fresh < self.capacity_blocks:
            block = self._next_fresh
            self._next_fresh += 1
        else:
            block, _ = self._free.popitem(last=False)
            self._evict(block)
        self._ref_cnt[block] = 1
        return block

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is None:
            return
        holders = self._cached[block_hash]
        del holders[block]
        if not holders:
            del self._cached[block_hash]
        self._hash[block] = None

    def _register(self, block: int, block_hash: BlockHash) -> None:
        if not self.enable_caching:
            return
        self._hash[block] = block_hash
        self._cached.setdefault(block_hash, {})[block] = None
