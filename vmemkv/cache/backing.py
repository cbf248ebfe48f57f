"""What memory stands behind each block of a pool: :class:`Backing`.

A block has memory behind it (``BACKED``) from the first time it is handed out; a free clean
block's memory can be given back to the OS (``GIVEN_BACK``) and taken again when it is handed out
next. Held and cached blocks are always backed. ``limit``, when set, caps the blocks backed at
once (a share of a KV budget shared with other engines, ``memory/budget.py``): the pool then
skips clean blocks without memory past it, and hands out clean blocks with memory, then cached
ones, instead.
"""

from __future__ import annotations

from typing import Callable, Iterable

NEVER, BACKED, GIVEN_BACK = 0, 1, 2


class Backing:
    """The memory state of ``num_blocks`` blocks, counted; the pool tells it which blocks are
    handed out (``back``) and which become clean (``cleaned``)."""

    def __init__(self, num_blocks: int):
        self.state = bytearray(num_blocks)  # NEVER / BACKED / GIVEN_BACK, per block
        self.num_backed = 0
        self.num_backed_clean = 0
        self.given_back = self.taken_again = 0  # blocks, since creation
        self.limit: int | None = None  # the most blocks backed at once; None: no limit
        # Called with a given-back block as it is handed out again, where memory does not come
        # back by itself when written (CUDA: KVMemory takes the block's pages again).
        self.on_take_again: Callable[[int], None] | None = None

    def back(self, block: int) -> None:
        """A clean block is handed out: it has memory behind it from now on."""
        state = self.state[block]
        if state == BACKED:
            self.num_backed_clean -= 1
            return
        if state == GIVEN_BACK:
            self.taken_again += 1
            if self.on_take_again is not None:
                self.on_take_again(block)
        self.state[block] = BACKED
        self.num_backed += 1

    def cleaned(self, count: int = 1) -> None:
        """``count`` held or cached (so backed) blocks became clean."""
        self.num_backed_clean += count

    def unbackable(self, num_clean: int) -> int:
        """Clean blocks (of ``num_clean``) without memory that ``limit`` does not let the pool back."""
        if self.limit is None:
            return 0
        return max(0, num_clean - self.num_backed_clean - max(0, self.limit - self.num_backed))

    def limited(self, n: int, num_clean: int) -> bool:
        """Whether handing out ``n`` clean blocks lowest id first could pass ``limit``."""
        return self.limit is not None and self.limit - self.num_backed < min(n, num_clean - self.num_backed_clean)

    def backable(self, clean: Iterable[int], n: int) -> list[int]:
        """Up to ``n`` of the ``clean`` blocks, lowest id first, skipping those without memory once
        ``limit`` is reached (O(clean blocks): only while the limit binds)."""
        allowance = self.limit - self.num_backed
        state, blocks = self.state, []
        for block in sorted(clean):
            if state[block] != BACKED:
                if allowance <= 0:
                    continue
                allowance -= 1
            blocks.append(block)
            if len(blocks) == n:
                break
        return blocks

    def candidates(self, clean: Iterable[int], n: int) -> list[int]:
        """Up to ``n`` of the ``clean`` blocks with memory behind them, highest id first (the
        last ones the pool hands out), to give their memory back."""
        if n <= 0 or not self.num_backed_clean:
            return []
        state = self.state
        return sorted((b for b in clean if state[b] == BACKED), reverse=True)[:n]

    def mark_given_back(self, blocks: list[int]) -> None:
        """The memory behind clean, backed ``blocks`` went back to the OS (checked by the pool)."""
        for block in blocks:
            self.state[block] = GIVEN_BACK
        self.num_backed -= len(blocks)
        self.num_backed_clean -= len(blocks)
        self.given_back += len(blocks)

    def check(self, held_or_cached: set[int], clean: set[int]) -> None:
        """Assert the counts and that held and cached blocks have memory."""
        state = self.state
        assert all(state[p] == BACKED for p in held_or_cached), "a held or cached block has no memory"
        assert self.num_backed == state.count(BACKED), "backed blocks miscounted"
        assert self.num_backed_clean == sum(state[p] == BACKED for p in clean), "backed clean blocks miscounted"
        assert self.limit is None or self.num_backed <= self.limit, (
            f"{self.num_backed} blocks backed past the limit of {self.limit}")
