"""Host block store: where blocks wait in host memory, bit for bit.

Two users share one store and its copy routines: swap preemption (a preempted request's private
blocks) and the prefix cache's host tier (``host_tier.py``: cached blocks evicted from the device
pool). ``store`` copies device blocks into free host rows, ``load`` copies host rows back into
device blocks and frees them, ``discard`` frees rows. Under tensor parallelism every rank's store
replays rank 0's calls in order (``engine/distributed/recorder.py``), so both users stay in step.

The copies themselves are the device's (``VirtualMemoryBackend.host_row_copier``): a plain row
copy where the rows are host memory, an asynchronous copy from pinned rows ordered against the
compute stream where the device needs one; the store only chooses rows.
"""

from __future__ import annotations

import heapq

import torch

from vmemkv.errors import VmemkvError
from vmemkv.memory.vmm.base import HostRowCopier


class OutOfSwapSpaceError(VmemkvError):
    """The host swap space cannot hold the blocks asked for; nothing was changed."""


class SwapSpace:
    """``num_blocks`` host blocks of ``block_bytes`` each, copied by ``copier`` (the pool's
    backend's ``host_row_copier()``; default: plain host row copies), pinned when it asks."""

    def __init__(self, num_blocks: int, block_bytes: int, copier: HostRowCopier | None = None):
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.copier = copier or HostRowCopier()
        self.storage = torch.empty((num_blocks, block_bytes), dtype=torch.uint8,
                                   pin_memory=self.copier.pin_host_memory and num_blocks > 0)
        self._free = list(range(num_blocks))  # a heap, so swapped blocks land together

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check_room(self, num_blocks: int) -> None:
        """Raise, changing nothing, unless ``num_blocks`` more blocks fit."""
        if num_blocks > self.num_free:
            raise OutOfSwapSpaceError(
                f"swapping out needs {num_blocks} blocks of {self.block_bytes} B, the swap space "
                f"has {self.num_free} free of {self.num_blocks}; raise swap_space_bytes or "
                "preempt by recompute")

    def store(self, window: torch.Tensor, blocks: list[int]) -> list[int]:
        """Copy device blocks (rows of ``window``, ``[num_blocks, block_bytes]``) to host; returns
        the host block ids that hold them."""
        self.check_room(len(blocks))
        host = [heapq.heappop(self._free) for _ in blocks]
        self._copy_rows(self.storage, host, window, blocks)
        return host

    def load(self, window: torch.Tensor, host: list[int], blocks: list[int]) -> None:
        """Copy host blocks back into device blocks and free the host blocks."""
        self._copy_rows(window, blocks, self.storage, host)
        self.discard(host)

    def discard(self, host: list[int]) -> None:
        for block in host:
            heapq.heappush(self._free, block)

    def _copy_rows(self, dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
                   src_rows: list[int]) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]``, by the device's copier."""
        if dst_rows:
            self.copier.copy(dst, dst_rows, src, src_rows)
