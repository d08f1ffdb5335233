"""The KV pool's capacity, from the GPU's memory (what vLLM does at start-up), and what fits in it.

vLLM profiles the model, then gives the KV cache what is left of ``gpu_memory_utilization`` x GPU
memory once the weights and the peak activation memory are taken:
``blocks = (total x utilization - weights - activations) // (block_size x bytes per token)``
(``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``). A running sequence holds
``ceil((prompt + generated) / block_size)`` blocks, so C sequences of a prompt of L tokens and N
output tokens fit while ``C x ceil((L + N) / block_size) <= blocks``; past that vLLM queues the
newcomers (TTFT jumps) or preempts running ones (recomputes them later).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class KVPool:
    """The blocks requests can use (vLLM's ``num_gpu_blocks`` minus its null block)."""

    blocks: int
    block_size: int = 16

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def max_context(self, concurrency: int, output_tokens: int = 0) -> int:
        """The longest prompt that ``concurrency`` sequences can each have at once, with their output."""
        if concurrency < 1:
            raise ValueError("concurrency must be positive")
        per_sequence = (self.blocks // concurrency) * self.block_size
        return max(0, per_sequence - output_tokens)

    def max_concurrency(self, context_tokens: int) -> int:
        """Sequences of ``context_tokens`` (prompt and output) that fit at once."""
        blocks = -(-max(context_tokens, 1) // self.block_size)
        return self.blocks // blocks


def pool_from_memory(
    gpu_memory_bytes: float,
    bytes_per_token: int,
    *,
    utilization: float = 0.9,
    weights_bytes: float = 0.0,
    activation_bytes: float = 0.0,
    block_size: int = 16,
) -> KVPool:
    if not 0 < utilization <= 1:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes per token and block size must be positive")
    available = gpu_memory_bytes * utilization - weights_bytes - activation_bytes
    # vLLM keeps one block aside (its null block): requests get the others.
    return KVPool(max(0, int(available // (bytes_per_token * block_size)) - 1), block_size)


def describe_pool(pool: KVPool, bytes_per_token: int, concurrencies: list[int], output_tokens: int) -> str:
    lines = [
        f"KV pool: {pool.blocks:,} blocks of {pool.block_size} tokens = {pool.tokens:,} tokens "
        f"({pool.tokens * bytes_per_token / GIB:.2f} GiB)",
        f"{'concurrency':>12} {'largest context that fits':>26}",
    ]
    for concurrency in concurrencies:
        lines.append(f"{concurrency:>12} {pool.max_context(concurrency, output_tokens):>26,}")
    if output_tokens:
        lines.append(f"(each sequence also holds its {output_tokens} output tokens)")
    return "\n".join(lines)
