"""What a request holds in the KV cache: :class:`Allocation`, one per request, on its
:class:`vmemkv.KVRequest` (``request.allocation``).

Its fields say where the request's K/V is (the slot while running, the blocks it holds a reference
on, in position order) and how far it got (positions reserved, computed, offered to the prefix
cache; blocks given back behind a sliding window; what is on the host while swapped out). A
manager reads them directly and changes them only through the transitions below, each of which
is one thing that happens to a request: bound (admitted), grown, committed, released behind its
window, swapped out and in, made a copy of another request (fork, beam reorder), truncated,
given lookahead blocks or had them taken back, reset. The pool's reference counts and the slot's
mappings are the manager's to keep in step; an allocation only records what was decided.

Callers read a request's allocation through the KVRequest's read-only properties (``slot``,
``block_table``, ``num_tokens``, ...); they never change it.
"""

from __future__ import annotations

# The block-list entry of a block given back behind a sliding window (no block held there).
RELEASED = -1


class Allocation:
    """One request's slot, blocks and counts (see the module's docstring). Invariants the manager
    keeps (``KVCacheManager.check``): ``num_computed <= num_tokens <= len(blocks) *
    tokens_per_page``; the first ``num_released`` blocks are ``RELEASED`` and no later one is;
    ``slot`` is None exactly while swapped out or idle."""

    __slots__ = ("slot", "blocks", "num_tokens", "num_computed", "num_registered", "num_released",
                 "swapped", "lossy_from")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Hold nothing (new, freed, or preempted by recompute)."""
        self.slot: int | None = None  # set while running
        self.blocks: list[int] = []  # one reference held on each (lookahead blocks at the end)
        self.num_tokens = 0  # positions reserved (written or about to be)
        self.num_computed = 0  # positions whose K/V is written
        self.num_registered = 0  # leading full blocks already offered to the prefix cache
        self.num_released = 0  # leading entries of blocks that are RELEASED (behind the window)
        self.swapped: list[tuple[int, int]] | None = None  # (index in blocks, host block) while swapped
        # the first block holding lossy KV (the cold tier's, or computed after reading such):
        # it and later blocks are offered to the prefix cache as lossy; None: all exact
        self.lossy_from: int | None = None

    # --- running -------------------------------------------------------------------------------
    def bind(self, slot: int, blocks: list[int], num_tokens: int, num_computed: int,
             num_registered: int, num_released: int) -> None:
        """Admitted into ``slot``: ``blocks`` (prefix hits first, ``RELEASED`` behind the window)
        reserve ``num_tokens`` positions, ``num_computed`` of them already cached."""
        self.slot, self.swapped = slot, None
        self.blocks = blocks
        self.num_tokens, self.num_computed = num_tokens, num_computed
        self.num_registered, self.num_released = num_registered, num_released

    def grow(self, num_new_tokens: int, new_blocks: list[int] = ()) -> None:
        """``num_new_tokens`` more positions reserved, in ``new_blocks`` appended (none while the
        positions fit the blocks held)."""
        if new_blocks:
            self.blocks += new_blocks
        self.num_tokens += num_new_tokens

    def commit(self, num_computed: int) -> None:
        """Positions up to ``num_computed`` are written."""
        self.num_computed = num_computed

    def register(self, num_registered: int) -> None:
        """The leading ``num_registered`` full blocks were offered to the prefix cache."""
        self.num_registered = num_registered

    def release_behind(self, first: int) -> list[int]:
        """The blocks before ``first`` not released yet become ``RELEASED``; returns them (the
        manager gives their references back)."""
        blocks, released = self.blocks, self.num_released
        given_back = blocks[released:first]
        blocks[released:first] = [RELEASED] * (first - released)
        self.num_released = first
        return given_back

    def add_lookahead(self, new_blocks: list[int]) -> None:
        """``new_blocks`` given early, past the reservation (mapped on another thread)."""
        self.blocks += new_blocks

    def drop_from(self, index: int) -> list[int]:
        """Blocks from ``index`` on (lookahead ones, or a cancelled lookahead job's) are not held
        any more; returns them."""
        dropped = self.blocks[index:]
        del self.blocks[index:]
        return dropped

    def replace_block(self, index: int, block: int) -> int:
        """Block ``index`` is now ``block`` (a private copy of it); returns the old one."""
        old, self.blocks[index] = self.blocks[index], block
        return old

    def truncate(self, num_tokens: int, num_blocks: int, num_full_blocks: int) -> list[int]:
        """Every position from ``num_tokens`` on is forgotten: blocks past the first
        ``num_blocks`` are not held any more (returned), and at most ``num_full_blocks`` stay
        registered."""
        dropped = self.drop_from(num_blocks)
        self.num_registered = min(self.num_registered, num_full_blocks)
        self.num_tokens = self.num_computed = num_tokens
        return dropped

    # --- copies of other requests ---------------------------------------------------------------
    def copy_from(self, source: "Allocation", slot: int, blocks: list[int], num_released: int) -> None:
        """This request becomes a copy of ``source`` (a fork child, a beam-search row) in
        ``slot``, holding ``blocks``: its counts are the source's, as they were when read."""
        self.slot, self.swapped = slot, None
        self.blocks = blocks
        self.num_tokens, self.num_computed = source.num_tokens, source.num_computed
        self.num_registered, self.num_released = source.num_registered, num_released
        self.lossy_from = source.lossy_from

    def snapshot(self) -> "Allocation":
        """A copy of the counts (blocks and slot shared, not copied): what ``copy_from`` reads
        when the source itself changes first (reorder)."""
        copy = Allocation.__new__(Allocation)
        for name in Allocation.__slots__:
            setattr(copy, name, getattr(self, name))
        return copy

    # --- swapped out ---------------------------------------------------------------------------
    def swap_out(self, swapped: list[tuple[int, int]]) -> None:
        """Off the device: block ``index`` of each ``(index, host block)`` pair is on the host
        (its reference given back); the other blocks stay held. No slot any more."""
        self.swapped, self.slot = swapped, None

    def swap_in(self, slot: int, blocks: list[int]) -> None:
        """Back in ``slot``, holding ``blocks`` (the host's copies in fresh blocks)."""
        self.blocks, self.swapped, self.slot = blocks, None, slot
