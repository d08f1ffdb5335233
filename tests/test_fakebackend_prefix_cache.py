"""The APC model against vLLM v1's rules, by example and by property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.enginemodel.prefix_cache import PrefixCache, RequestBlocks, block_hashes, hash_block_tokens

BS = 4


def run(cache: PrefixCache, prompt: list[int], output: list[int] | None = None, salt: str | None = None) -> int:
    """Admit, generate ``output`` (default: one token) and finish; return cached tokens."""
    request = cache.admit(prompt, salt)
    assert request is not None
    cache.finish(request, output if output is not None else [999])
    return request.num_cached_tokens


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class TestHashes:
    def test_chained_hash_changes_with_parent_tokens_and_salt(self) -> None:
        a = hash_block_tokens(None, [1, 2, 3, 4])
        assert a == hash_block_tokens(None, [1, 2, 3, 4])
        assert a != hash_block_tokens(None, [1, 2, 3, 5])
        assert a != hash_block_tokens(a, [1, 2, 3, 4])
        assert a != hash_block_tokens(None, [1, 2, 3, 4], ("tenant",))
        assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))

    def test_only_full_blocks_are_hashed(self) -> None:
        assert len(block_hashes(seq(0, 11), BS)) == 2
        assert block_hashes(seq(0, 3), BS) == []

    def test_one_changed_token_changes_that_block_and_every_later_one(self) -> None:
        base = seq(0, 20)
        for k in range(5):
            changed = list(base)
            changed[k * BS + 1] = -1
            a, b = block_hashes(base, BS), block_hashes(changed, BS)
            assert a[:k] == b[:k]
            assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))

    def test_salt_only_enters_the_first_block_but_propagates(self) -> None:
        plain, salted = block_hashes(seq(0, 12), BS), block_hashes(seq(0, 12), BS, "s")
        assert all(x != y for x, y in zip(plain, salted, strict=True))

    def test_continuing_a_chain_matches_hashing_at_once(self) -> None:
        tokens = seq(0, 20)
        head = block_hashes(tokens[:8], BS)
        assert head + block_hashes(tokens, BS, parent=head[-1], start_block=2) == block_hashes(tokens, BS)


class TestLookup:
    def test_first_request_misses_second_hits_full_blocks(self) -> None:
        cache = PrefixCache(BS, 64)
        assert run(cache, seq(0, 10)) == 0
        assert run(cache, [*seq(0, 10), 50, 51]) == 8

    def test_change_in_block_k_misses_k_and_later(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 21))
        for k in range(5):
            prompt = seq(0, 21)
            prompt[k * BS] = -7
            assert cache.lookup(prompt) == k * BS

    def test_partial_block_never_hits(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 7), output=[])  # 1 full block + 3 tokens
        assert cache.lookup([*seq(0, 7), 100]) == 4

    def test_fully_cached_prompt_still_recomputes_a_token(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, [*seq(0, 8), 1, 2, 3, 4], output=[9])
        # Block-aligned prompt fully cached: the last block is recomputed (cap = len - 1).
        assert cache.lookup(seq(0, 8)) == 4
        assert run(cache, seq(0, 8)) == 4
        assert cache.lookup(seq(0, 9)) == 8

    def test_generated_tokens_are_cached_except_the_last_sampled(self) -> None:
        cache = PrefixCache(BS, 64)
        prompt, output = seq(0, 6), seq(100, 7)  # computed: 6 + 6 = 12 tokens = 3 blocks
        run(cache, prompt, output)
        next_turn = prompt + output + [500, 501, 502]
        assert cache.lookup(next_turn) == 12
        # One more output token would have completed the fourth block.
        cache2 = PrefixCache(BS, 64)
        run(cache2, prompt, seq(100, 11))
        assert cache2.lookup(prompt + seq(100, 11) + [7]) == 16

    def test_lookup_changes_nothing(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 9))
        before = (cache.stats.queries, cache.stats.hits, cache.num_free_blocks)
        cache.lookup(seq(0, 9))
        assert (cache.stats.queries, cache.stats.hits, cache.num_free_blocks) == before

    def test_cache_salt_isolates_tenants(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 9), salt="a")
        assert cache.lookup(seq(0, 9), "a") == 8
        assert cache.lookup(seq(0, 9), "b") == 0
        assert cache.lookup(seq(0, 9)) == 0

    def test_blocks_of_a_running_request_are_hit_by_the_next(self) -> None:
        cache = PrefixCache(BS, 64)
        first = cache.admit(seq(0, 9))
        assert first is not None
        second = cache.admit(seq(0, 9))
        assert second is not None and second.num_cached_tokens == 8
        cache.finish(first, [1])
        cache.finish(second, [1])
        assert cache.num_used_blocks == 0

    def test_disabled_caching_never_hits_or_counts(self) -> None:
        cache = PrefixCache(BS, 64, enable_caching=False)
        run(cache, seq(0, 9))
        assert run(cache, seq(0, 9)) == 0
        assert cache.stats.queries == 0
        assert cache.num_cached_blocks == 0


class TestAccounting:
    def test_stats_count_prompt_tokens_and_hits(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 10))
        run(cache, seq(0, 10))
        assert (cache.stats.requests, cache.stats.queries, cache.stats.hits) == (2, 20, 8)
        assert cache.stats.hit_rate == pytest.approx(0.4)

    def test_usage_counts_blocks_held_by_running_requests_only(self) -> None:
        cache = PrefixCache(BS, 10)
        request = cache.admit(seq(0, 9))  # 3 blocks
        assert request is not None
        assert cache.usage == pytest.approx(0.3)
        cache.finish(request, [1])
        assert cache.usage == 0.0
        assert cache.num_cached_blocks == 2

    def test_duplicate_blocks_are_kept_like_vllm(self) -> None:
        cache = PrefixCache(BS, 64)
        run(cache, seq(0, 8), output=[])
        run(cache, seq(0, 8), output=[])  # recomputes block 1: a second copy of its hash
        assert cache.num_cached_blocks == 3

    def test_finish_is_idempotent(self) -> None:
        cache = PrefixCache(BS, 8)
        request = cache.admit(seq(0, 8))
        assert request is not None
        cache.finish(request, [1, 2])
        cache.finish(request, [1, 2])
        assert cache.num_free_blocks == 8

    def test_reset_refused_while_running(self) -> None:
        cache = PrefixCache(BS, 8)
        request = cache.admit(seq(0, 8))
        assert request is not None
        assert cache.reset() is False
        cache.finish(request, [1])
        assert cache.reset() is True
        assert cache.lookup(seq(0, 9)) == 0

    def test_empty_and_oversized_prompts_are_rejected(self) -> None:
        cache = PrefixCache(BS, 2)
        with pytest.raises(ValueError):
            cache.admit([])
        with pytest.raises(ValueError):
            cache.admit(seq(0, 9))


class TestEviction:
    def test_admission_waits_when_blocks_are_held(self) -> None:
        cache = PrefixCache(BS, 4)
        first = cache.admit(seq(0, 12))  # 3 blocks
        assert first is not None
        assert cache.admit(seq(100, 8)) is None  # needs 2, only 1 free
        cache.finish(first, [1])
        assert cache.admit(seq(100, 8)) is not None

    def test_lru_evicts_least_recently_freed_and_tail_blocks_first(self) -> None:
        cache = PrefixCache(BS, 4)
        a, b = seq(0, 8), seq(100, 8)
        run(cache, a, output=[])  # free queue: a1, a0
        run(cache, b, output=[])  # free queue: a1, a0, b1, b0
        run(cache, seq(200, 12), output=[])  # takes a1, a0, b1
        assert cache.lookup([*a, 1]) == 0
        assert cache.lookup([*b, 1]) == 4  # b0 survives, b1 (the tail block) went first

    def test_a_hit_refreshes_recency(self) -> None:
        cache = PrefixCache(BS, 4)
        a, b = seq(0, 8), seq(100, 8)
        run(cache, a, output=[])
        run(cache, b, output=[])
        assert run(cache, [*a, 1], output=[]) == 8  # touch a: now most recently freed
        run(cache, seq(200, 8), output=[])  # takes the two oldest free blocks: b's
        assert cache.lookup([*b, 1]) == 0
        assert cache.lookup([*a, 1]) == 8

    def test_hit_blocks_cannot_be_evicted_by_their_own_request(self) -> None:
        cache = PrefixCache(BS, 3)
        run(cache, seq(0, 8), output=[])
        # Hits 2 blocks (removed from the free queue) and needs 1 new: exactly fits.
        request = cache.admit([*seq(0, 8), 9, 9, 9])
        assert request is not None and request.num_cached_tokens == 8
        cache.finish(request, [1])
        assert cache.lookup([*seq(0, 8), 9]) == 8


# -- properties ----------------------------------------------------------------------------

tokens = st.lists(st.integers(0, 2), min_size=1, max_size=24)


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple[list[int], list[int]]]:
    """Requests that often extend earlier prompts (+ replies), as chat turns do."""
    jobs: list[tuple[list[int], list[int]]] = []
    for _ in range(draw(st.integers(1, 12))):
        extend_earlier = draw(st.booleans())
        if jobs and extend_earlier:
            prompt, output = jobs[draw(st.integers(0, len(jobs) - 1))]
            base = (prompt + output)[: draw(st.integers(0, len(prompt + output)))]
        else:
            base = []
        prompt = base + draw(tokens)
        jobs.append((prompt, draw(st.lists(st.integers(0, 2), max_size=10))))
    return jobs


def reference_hit(history: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Infinite cache: longest block-aligned common prefix with anything computed, capped."""
    best = 0
    for computed in history:
        common = 0
        for x, y in zip(computed, prompt, strict=False):
            if x != y:
                break
            common += 1
        best = max(best, common // block_size)
    return min(best, (len(prompt) - 1) // block_size) * block_size


@settings(max_examples=200, deadline=None)
@given(workloads(), st.integers(1, 5))
def test_unbounded_cache_matches_reference(jobs: list[tuple[list[int], list[int]]], block_size: int) -> None:
    cache = PrefixCache(block_size, 10_000)
    history: list[list[int]] = []
    total_hits = 0
    for prompt, output in jobs:
        expected = reference_hit(history, prompt, block_size)
        assert run(cache, prompt, output) == expected
        total_hits += expected
        history.append(prompt + output[:-1])
    assert cache.stats.hits == total_hits
    assert cache.stats.queries == sum(len(prompt) for prompt, _ in jobs)
    assert cache.usage == 0.0


@settings(max_examples=200, deadline=None)
@given(workloads(), st.integers(1, 4), st.integers(8, 20), st.data())
def test_bounded_cache_invariants(
    jobs: list[tuple[list[int], list[int]]], block_size: int, capacity: int, data: st.DataObject
) -> None:
    cache = PrefixCache(block_size, capacity)
    history: list[list[int]] = []
    running: list[tuple[RequestBlocks, list[int]]] = []
    for prompt, output in jobs:
        if cache.blocks_needed(len(prompt)) > capacity:
            continue
        request = cache.admit(prompt)
        while request is None:  # finish the oldest running request until it fits
            old, old_output = running.pop(0)
            cache.finish(old, old_output)
            history.append(old.prompt_token_ids + old_output[:-1])
            request = cache.admit(prompt)
        hit = request.num_cached_tokens
        assert hit % block_size == 0 and hit <= len(prompt) - 1
        # Eviction can only lose hits; running prompts count as computed.
        running_prompts = [r.prompt_token_ids for r, _ in running]
        assert hit <= reference_hit(history + running_prompts, prompt, block_size)
        assert cache.num_used_blocks <= capacity
        running.append((request, output))
        if data.draw(st.booleans()):
            old, old_output = running.pop(data.draw(st.integers(0, len(running) - 1)))
            cache.finish(old, old_output)
            history.append(old.prompt_token_ids + old_output[:-1])
    for request, output in running:
        cache.finish(request, output)
    assert cache.num_used_blocks == 0
    assert cache.num_free_blocks == capacity
    assert 0 <= cache.stats.hits <= cache.stats.queries
