"""Compaction of old conversation turns into a stable, cache-friendly summary."""
