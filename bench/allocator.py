"""Large buffers a process frees kept for its next request: glibc's malloc told not to hand them back.

The bare stack (``bench.bare_hop``) reads a body from the client and writes it upstream, nothing
else. With 1.2 MB bodies (a 1,000-turn agent conversation) glibc serves its buffers with ``mmap``,
or from the top of its heap, which it trims once that much is free again: each request's buffers
are fresh pages, faulted in and zeroed (14% of its samples under ``perf``; 2.5-2.9 ms of CPU a
request, 1.6-1.8 ms with the memory kept). prefix-proxy itself does not pay this: what it keeps
between requests holds its heap, and it takes about 47 page faults a request at 1,000 agent turns
with glibc's defaults or with the memory kept (``perf stat``), with no difference in CPU. So the
floor of a hop keeps its freed memory too, or it would charge the transport with faults the proxy
never takes.

:func:`keep_freed_memory` raises glibc's mmap threshold to its maximum (32 MiB on 64-bit) and its
trim threshold to ``keep_bytes``. Not glibc (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB where a long is 8 bytes.
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
KEEP_FREED_BYTES = 64 * 1024 * 1024


def keep_freed_memory(keep_bytes: int) -> bool:
    """Up to ``keep_bytes`` of freed memory kept for reuse (0: glibc's own policy, untouched); True
    when glibc took the settings."""
    if keep_bytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # noqa: B018 -- present in glibc only (musl has a mallopt that does nothing)
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Setting either threshold stops glibc adjusting both on its own, so both are set.
    mapped = mallopt(M_MMAP_THRESHOLD, min(MMAP_THRESHOLD_MAX, keep_bytes))
    trimmed = mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1))
    return bool(mapped and trimmed)
