"""Host swap space: where a preempted request's private blocks wait, bit for bit."""

from __future__ import annotations

import heapq

import torch

from .errors import VmemkvError


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
        if blocks and window.device.type == "cpu":
            # row copies: torch's indexed copies of uint8 rows run element by element on the
            # CPU (~10x slower than a memcpy per row for a few blocks)
            for block, slot in zip(blocks, host):
                self.storage[slot].copy_(window[block])
        elif blocks:
            index = torch.tensor(blocks, dtype=torch.long, device=window.device)
            self.storage[torch.tensor(host)] = window.index_select(0, index).to("cpu")
        return host

    def load(self, window: torch.Tensor, host: list[int], blocks: list[int]) -> None:
        """Copy host blocks back into device blocks and free the host blocks."""
        if host and window.device.type == "cpu":
            for slot, block in zip(host, blocks):
                window[block].copy_(self.storage[slot])
        elif host:
            index = torch.tensor(blocks, dtype=torch.long, device=window.device)
            window.index_copy_(0, index, self.storage[torch.tensor(host)].to(window.device))
        self.discard(host)

    def discard(self, host: list[int]) -> None:
        for block in host:
            heapq.heappush(self._free, block)
