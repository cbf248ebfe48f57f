"""The kernel's cap on mappings (VMAs) per process, and the share vmemkv's CPU backends may use.

See :mod:`vmemkv.memory.vmm.cpu` for why the cap matters for the page size. Also: huge-page facts from
/proc/meminfo.
"""

from __future__ import annotations

import threading

import numpy as np

MAX_MAP_COUNT_PATH = "/proc/sys/vm/max_map_count"
DEFAULT_MAX_MAP_COUNT = 65530



def read_max_map_count() -> int:
    """The kernel's ``vm.max_map_count`` (the default when it cannot be read)."""
    try:
        with open(MAX_MAP_COUNT_PATH) as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def count_process_mappings() -> int:
    """How many VMAs this process has now (lines of ``/proc/self/maps``)."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def count_range_mappings(page_table: np.ndarray) -> int:
    """The VMAs a range with this page table costs: one per run of consecutive physical pages and
    one per unmapped gap (the same rule the native mapper counts with)."""
    table = np.asarray(page_table, dtype=np.int64)
    if table.size == 0:
        return 0
    prev, cur = table[:-1], table[1:]
    same_vma = ((prev < 0) & (cur < 0)) | ((prev >= 0) & (cur == prev + 1))
    return 1 + int(np.count_nonzero(~same_vma))


def huge_page_info() -> tuple[int, int]:
    """(HugePages_Total, Hugepagesize in bytes) from /proc/meminfo; (0, 0) when unknown."""
    total = size = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Total:"):
                    total = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total, size


class ProcessMappingBudget:
    """The VMAs all CPU backends of this process may hold together.

    Measured once, when the first backend is built: ``vm.max_map_count`` minus the mappings the
    process already had, minus a margin for what the rest of the process maps later.
    """

    def __init__(self) -> None:
        self.max_map_count = read_max_map_count()
        self.mapped_elsewhere = count_process_mappings()
        self.margin = max(4096, self.max_map_count // 10)
        self.limit = max(0, self.max_map_count - self.mapped_elsewhere - self.margin)
        self.used = 0

    def describe(self) -> str:
        return (f"vm.max_map_count is {self.max_map_count}; the rest of the process mapped "
                f"{self.mapped_elsewhere} and {self.margin} are kept as a margin, leaving "
                f"{self.limit} for vmemkv's CPU backends")


_budget: ProcessMappingBudget | None = None
budget_lock = threading.Lock()  # guards the budget and serializes map/unmap across threads


def process_mapping_budget() -> ProcessMappingBudget:
    """The process-wide budget (created on first use)."""
    global _budget
    with budget_lock:
        if _budget is None:
            _budget = ProcessMappingBudget()
        return _budget
