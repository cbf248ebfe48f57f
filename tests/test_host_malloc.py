"""The CPU engine's allocator settings (engine/core/host_malloc.py): freed activations are reused
without new page faults, and ``give_back_freed_memory`` returns them to the system."""

import os
import resource
import subprocess
import sys

import pytest
import torch

from vmemkv.engine.core.host_malloc import give_back_freed_memory, keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

MB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


REUSE = """
import resource, torch
from vmemkv.engine.core.host_malloc import keep_freed_memory
assert keep_freed_memory()  # glibc took the settings
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # the heap grows to hold them (glibc's own default keeps faulting here)
    torch.empty(20 * 2**20 // 4).fill_(1.0)
counts = []
for _ in range(3):  # three measurements: one fresh region now and then (seen once in CI) is no trend
    before = faults()
    for _ in range(5):  # an op's output of 20 MB, freed before the next op's
        torch.empty(20 * 2**20 // 4).fill_(1.0)
    counts.append(faults() - before)
print(min(counts))
"""


def test_a_freed_activation_is_reused_without_page_faults():
    # a fresh process: the heap's state after other tests would decide when it grows
    out = subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    pages = 5 * 20 * MB // resource.getpagesize()
    assert int(out.stdout.split()[-1]) < pages // 10  # without the settings: thousands a cycle


def test_give_back_returns_the_freed_heap():
    assert keep_freed_memory()
    blocks = [torch.ones(16 * MB // 4) for _ in range(12)]  # 192 MB from the heap (< mmap threshold)
    del blocks
    held = resident_bytes()
    give_back_freed_memory()
    assert held - resident_bytes() > 128 * MB
