"""Host block store: where blocks wait in host memory, bit for bit.

Two users share one store and its copy routines: swap preemption (a preempted request's private
blocks) and the prefix cache's host tier (``host_tier.py``: cached blocks evicted from the device
pool). ``store`` copies device blocks into free host rows, ``load`` copies host rows back into
device blocks and frees them, ``discard`` frees rows. Under tensor parallelism every rank's store
replays rank 0's calls in order (``engine/distributed/recorder.py``), so both users stay in step.

On CUDA the host rows are pinned and every copy runs on a side stream, asynchronously for the
host: the side stream first waits for the compute stream (the blocks' bytes are final), and the
compute stream then waits for the copy's event, so the next kernel that writes a demoted block or
reads a loaded one is ordered after the copy, and the step thread never blocks. Copies on the side
stream run in issue order, so a host row reused for another block is never overwritten before
the earlier copy out of it finished. On the CPU a copy is a plain row copy.
"""

from __future__ import annotations

import heapq

import torch

from vmemkv.errors import VmemkvError


class OutOfSwapSpaceError(VmemkvError):
    """The host swap space cannot hold the blocks asked for; nothing was changed."""


class SwapSpace:
    """``num_blocks`` host blocks of ``block_bytes`` each (pinned when the pool is on a GPU)."""

    def __init__(self, num_blocks: int, block_bytes: int, pin_memory: bool = False):
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.storage = torch.empty((num_blocks, block_bytes), dtype=torch.uint8,
                                   pin_memory=pin_memory and num_blocks > 0)
        self._free = list(range(num_blocks))  # a heap, so swapped blocks land together
        self._copy_stream: torch.cuda.Stream | None = None  # made at the first CUDA copy

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
        """``dst[dst_rows[i]] = src[src_rows[i]]``, row by row: torch's indexed copies of uint8
        rows run element by element on the CPU (~10x slower than a memcpy per row; numpy's row
        assignment costs a tenth of a torch row copy), and a row copy between pinned host memory
        and the device is one asynchronous memcpy."""
        if not dst_rows:
            return
        device = dst.device if dst.device.type == "cuda" else src.device
        if device.type != "cuda":
            dst_array, src_array = dst.numpy(), src.numpy()
            for d, s in zip(dst_rows, src_rows):
                dst_array[d] = src_array[s]
            return
        compute = torch.cuda.current_stream(device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        self._copy_stream.wait_stream(compute)  # the blocks' bytes are final
        with torch.cuda.stream(self._copy_stream):
            for d, s in zip(dst_rows, src_rows):
                dst[d].copy_(src[s], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        compute.wait_event(done)  # the next kernel that touches these blocks runs after the copy
