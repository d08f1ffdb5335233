"""bench/allocator.py: the floor of a hop keeps large freed buffers, as the proxy's heap does.

Each check runs in a fresh interpreter: glibc's thresholds are process-wide and not undone.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from bench.allocator import KEEP_FREED_BYTES, keep_freed_memory

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Page faults per round of a request-sized life: a 3 MiB buffer zeroed, copied, both freed.
_ROUNDS = textwrap.dedent(
    """
    import resource, sys
    from bench.allocator import keep_freed_memory
    took = keep_freed_memory(int(sys.argv[1]))
    size = 3 * 1024 * 1024
    bytes(bytearray(size))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        buffer = bytearray(size)
        copy = bytes(buffer)
        del buffer, copy
    print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
    """
)


def _faults_per_round(keep_bytes: int) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, str(keep_bytes)], capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took == "True", float(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_large_buffer_freed_is_reused_not_faulted_in_again() -> None:
    # 3 MiB is 768 pages: glibc's own policy maps (or trims) and faults them in every round.
    took, default = _faults_per_round(0)
    assert not took and default > 500
    took, kept = _faults_per_round(KEEP_FREED_BYTES)
    assert took and kept < 100


def test_zero_leaves_the_allocator_alone() -> None:
    assert keep_freed_memory(0) is False
