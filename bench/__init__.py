"""Reproducible benchmarks (run as modules: python -m bench.<name>)."""
