"""Real vLLM (CPU build) for benchmarks and tests: see README.md."""
