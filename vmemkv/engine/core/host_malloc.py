"""glibc's allocator told to keep the memory a CPU forward frees, for the next forward.

A CPU prefill step allocates activations of megabytes per op (SmolLM2-135M's MLP at 2,048 tokens:
12.6 MB a tensor). glibc serves a block over its mmap threshold with a fresh ``mmap`` and returns
it to the system on ``free``, and trims the heap's top once more than its trim threshold is free,
so the next op faults every page in again: ~240,000 minor page faults (about 1 GB) and 0.5 s of
system time in a 3.5 s prefill step of 2,048 tokens at two threads. vLLM's CPU backend avoids it
by preloading tcmalloc; here ``keep_freed_memory`` raises the mmap threshold to glibc's maximum
(32 MiB on 64-bit), so such blocks come from the heap, and keeps freed memory at the heap's top,
once, at the first CPU engine's start (``mallopt``; no effect elsewhere, e.g. under musl or macOS,
or with another allocator preloaded). The process then keeps its peak heap instead of returning
it, as a serving process would anyway; ``give_back_freed_memory`` returns it where that matters
(a level-2 sleep, which frees the weights).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TOP_PAD = 64 << 20  # grow the heap in steps this large: fewer brk calls while it fills


@functools.cache
def _glibc():
    """libc, when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds (once a process); whether glibc took them."""
    if (libc := _glibc()) is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, TOP_PAD))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (``malloc_trim``), e.g. after freeing weights."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)
