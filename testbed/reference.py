"""What the prefill a proxy saves is worth, as GPU time on a stated reference GPU.

An H100-class GPU (H100 SXM: 989 TFLOPS dense BF16, NVIDIA's H100 datasheet) running Llama-3.1-8B
in BF16 (8.03 B parameters, 32 layers of 4,096: Meta's model card). A prompt token's prefill is
about 2 x 8.03 = 16.1 GFLOP for the weights and 2 x 32 x 4,096 x 8,192 = 2.1 GFLOP for attention
over an 8k-token context; at half the peak (a prefill's usual model FLOPs utilization) that is about
27,000 tokens/s, taken as 25,000: 40 us of GPU time a token. An estimate from the hardware's and the
model's published figures, not a measurement (``bench.hop --prefill-rate`` states another).
"""

REFERENCE_GPU = "an H100-class GPU running Llama-3.1-8B (BF16)"
PREFILL_TOKENS_PER_S = 25_000


def gpu_ms(tokens: float, tokens_per_s: float = PREFILL_TOKENS_PER_S) -> float:
    """Milliseconds of the reference GPU's prefill for ``tokens`` prompt tokens."""
    return 1000.0 * tokens / tokens_per_s
