"""Host memory that the engine frees stays with the process for the next step.

A CPU step allocates tensors of tens of MB and frees them again: a verify forward's
full-vocabulary logits (8 requests x 16 tree nodes x 49,152 tokens x 4 bytes = 25 MB), a
prompt's MLP activations (1,536 tokens x 3,072 x 4 = 19 MB a layer). glibc's malloc
serves requests above its mmap threshold (at most 32 MB) with a fresh `mmap` and gives
them back with `munmap` on free, and returns the top of its heap to the system once more
than its trim threshold lies free there; either way the next step's tensor lands on
pages the kernel must fault in and zero again, one 4 KB page at a time: 12,000 to 52,000
page faults a step for 8-32 EAGLE-2/3 requests on the 2-core EPYC; with the memory kept,
their steps at 16-32 requests took 0.86-0.90 of the time (docs/benchmarks.md 2.10).

`keep_freed_memory` sets glibc's knobs once, after the weights are loaded: no `mmap` for
any allocation (`M_MMAP_MAX` 0: every block comes from a heap, where a freed one is
reused), no trimming of the heap (`M_TRIM_THRESHOLD` at its largest), and a top pad of a
thread arena's largest heap (`M_TOP_PAD` 64 MB), without which the engine's thread (a
server steps in one) still met thousands of faults a step: glibc hands an emptied heap
of a thread's arena back unless the top pad asks to keep that much. A block above 64 MB
in a thread other than the main one still comes from `mmap`: glibc falls back to it
whatever the settings. The price: the process holds its peak host memory until it exits,
as PyTorch's CUDA caching allocator holds GPU memory, and as the tcmalloc and jemalloc
that vLLM's and Intel's CPU guides preload do, which a Triton Python backend cannot
preload into its stub. The garbage of loading is handed back first (`malloc_trim`).
Other C libraries (musl, macOS) are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Optional

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
THREAD_HEAP = 64 * 2**20  # glibc's largest heap of a thread's arena (64-bit)
LARGEST_INT = 2**31 - 1  # mallopt takes an int


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> Optional[str]:
    """Has this process's malloc keep what it frees (see the module's docstring).
    Returns a line for the load log, or None where the C library is not glibc or
    refused a setting."""
    libc = _glibc()
    if libc is None:
        return None
    libc.malloc_trim(0)  # what loading left free goes back first
    if (libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, LARGEST_INT) != 1
            or libc.mallopt(M_TOP_PAD, THREAD_HEAP) != 1):
        return None
    return "host memory freed by a step kept for the next (glibc: no mmap, no heap trimming)"
