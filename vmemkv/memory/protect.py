"""Keep other processes of the same user out of this process's KV memory: :func:`protect_kv_memory`.

An engine's KV pages live in a memfd (CPU) or its CUDA allocations. Any process of the same user
may open ``/proc/<pid>/fd/<memfd>``, read ``/proc/<pid>/mem`` or attach a debugger, and so read
every request's KV cache. A process that is not *dumpable* (``prctl(PR_SET_DUMPABLE, 0)``) refuses
them all (only root, or a process with ``CAP_SYS_PTRACE``, still gets in), and writes no core dump.
It is not a boundary between users: tenants on one machine need separate users (or containers).
"""

from __future__ import annotations

import ctypes
import os
import sys

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4


def _prctl(option: int, value: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                        ctypes.c_ulong(0))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")
    return result


def protect_kv_memory() -> bool:
    """Make this process non-dumpable (Linux); returns whether it could (False elsewhere). A
    process it starts with exec is dumpable again, so each engine process calls this itself."""
    if not sys.platform.startswith("linux"):
        return False
    _prctl(_PR_SET_DUMPABLE, 0)
    return True


def is_dumpable() -> bool:
    """Whether this process is dumpable (always True off Linux)."""
    return not sys.platform.startswith("linux") or _prctl(_PR_GET_DUMPABLE) != 0
