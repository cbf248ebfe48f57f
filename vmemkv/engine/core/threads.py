"""How many intra-op threads torch computes with: ``EngineConfig.threads``, and the default the
entry points (``vmemkv generate``, ``vmemkv serve``, ``LLM``) give it.

torch's own default is one thread per core of the machine. On a machine whose cores are busy
with other work (or with this process's own HTTP front end, tokenizer and engine loop), every
thread torch starts competes for them, and its threads wait on each other: on a loaded 2-core
machine a chat reply took 35 s with torch's two threads and 2.2 s with one. So the default leaves
one of the cores this process may run on (``os.sched_getaffinity``) to the rest, as vLLM keeps
one core for its front end; pass ``threads`` to use them all on a quiet machine.
"""

from __future__ import annotations

import os

from vmemkv.errors import ConfigError


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def default_threads() -> int:
    """The cores this process may run on, less one, and at least one."""
    return max(1, available_cores() - 1)


def check_threads(threads: int | None) -> int | None:
    if threads is not None and (type(threads) is not int or threads < 1):
        raise ConfigError(f"threads is {threads!r}; pass a whole number >= 1 (the intra-op threads "
                          f"torch computes with; {available_cores()} core(s) here), or None to "
                          "leave torch's setting as it is")
    return threads


def apply_threads(threads: int | None) -> None:
    """Make torch compute with ``threads`` intra-op threads (None: leave it as it is)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
