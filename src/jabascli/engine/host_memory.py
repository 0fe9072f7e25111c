"""Host memory a trainer keeps: the blocks an iteration frees serve the next one (glibc's ``malloc``).

Every iteration allocates the same activations and gradients and frees them
again. glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at
first, raised as mmapped blocks are freed, never above 32 MiB) with a fresh
``mmap`` and unmaps it on free, and it trims the heap's free top above its trim
threshold: either way the next iteration touches fresh pages, a page fault and
a zeroed page each. How often depends on the order of the process's earlier
allocations, so it differs between processes that train the same thing. On
the 2-core development host, two ranks of the tiny ViT at LBS 128 each took
20,000-125,000 page faults per 5 s in jabas's trainers and 5,000-39,000 in
plain DDP processes (``benchmarks/uneven_ddp.py``), and jabas measured 0.87-0.97x
plain DDP's speed on the same split (``benchmarks/same_split.py``).

:func:`keep_freed_memory` sets both thresholds once, when a trainer or a
profiler's measurement starts (``mallopt``): blocks up to 32 MiB come from the
heap, which is never trimmed, so from the second iteration on the same pages
serve again (a few hundred page faults per 5 s). With it, the same split
measured 1.02x plain DDP's speed with the same setting. The process keeps its
peak heap, which its next iteration needs anyway; the emulated memory limit
counts tensors, not pages, so it is unchanged.

A no-op where the C library has no ``mallopt`` (macOS) or refuses the values;
a GPU's memory is its caching allocator's either way.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit hosts (half its ``HEAP_MAX_SIZE``): larger values are refused."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Never trim: the largest ``int`` ``mallopt`` takes."""


def keep_freed_memory() -> bool:
    """Make ``malloc`` keep freed blocks for reuse in this process (the module doc); True when it took both."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took_mmap = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    took_trim = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return took_mmap and took_trim
