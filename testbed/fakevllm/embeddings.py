"""Deterministic embedding vectors: the same input always maps to the same unit vector."""

from __future__ import annotations

import base64
import math
import struct

import xxhash


def embed(key: bytes, dim: int) -> list[float]:
    """A unit-length vector seeded by ``key`` (distinct inputs give unrelated vectors)."""
    seed = xxhash.xxh64_intdigest(key)
    raw = [(xxhash.xxh64_intdigest(i.to_bytes(4, "little"), seed=seed) / 2**63) - 1.0 for i in range(dim)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


def truncate_and_normalize(vector: list[float], dim: int) -> list[float]:
    """Matryoshka-style ``dimensions``: keep the first ``dim`` values, renormalize."""
    head = vector[:dim]
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def to_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format="base64"``: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
