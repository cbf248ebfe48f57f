"""The block pool: reference counts, the free queues, and the prefix-cache index.

Every block is in exactly one state:

* **in use**: ``ref > 0``; never handed out again, never evicted.
* **cached**: ``ref == 0`` with a content hash; its bytes are kept, it sits in the LRU queue and can
  be revived by a prefix hit (``acquire``), which takes it out of the queue in O(1).
* **clean**: ``ref == 0`` and no hash; handed out first, lowest block id first, so fresh requests
  get consecutive blocks that the mapper coalesces into one call.

Eviction is lazy: a cached block keeps its bytes and hash until ``allocate`` needs it, which drops
the hash then. The pool is mechanism only; the manager decides what to free and in what order.

Every change of the hash index is told to the ``events`` sink (``kv_events.py``): a hash newly
registered (``BlockStored``), hashes dropped when their blocks are taken (``BlockRemoved``), a
reset (``AllBlocksCleared``). Beside the index the pool keeps each hashed block's tokens under its
chain parent, so a caller can ask how many tokens past its full-page hits a cached page shares
with its prompt (``shared_partial_tokens``): hits a page-granular cache cannot give.

A cached block about to be handed out again is first offered to ``on_evict`` (the prefix cache's
host tier, ``host_tier.py``), with its hash, tokens and chain parent, after its ``BlockRemoved``
event and before ``allocate`` returns: its bytes are still intact then, and the caller writes it
only later.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from vmemkv.cache.backing import BACKED, Backing
from vmemkv.errors import BlockStateError, OutOfBlocksError
from vmemkv.cache.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink

# shared_partial_tokens compares the prompt with at most this many cached pages (the newest) that
# continue the same prefix with the same first token, so an admission never scans the whole cache.
PARTIAL_MATCH_CANDIDATES = 64




class BlockOrigin(NamedTuple):
    """What a hashed block was registered with: its tokens and its place in the hash chain."""
    token_ids: tuple[int, ...]
    parent_hash: bytes | None  # None: a prompt's first block
    root: bytes | None  # the chain's root (the hash of its cache keys), for a first block


class EvictedBlock(NamedTuple):
    """A cached block ``allocate`` is handing out again, with what it held."""
    block: int
    block_hash: bytes
    origin: BlockOrigin


@dataclass
class PoolCounters:
    num_blocks: int
    in_use: int
    cached: int
    clean: int
    evictions: int
    backed: int = 0  # blocks with memory behind them (BlockPool.backing, backing.py)
    given_back: int = 0
    taken_again: int = 0

    @property
    def free(self) -> int:
        return self.cached + self.clean


class BlockPool:
    """The pool of KV-cache blocks. A block is the unit the manager hands out and counts (a
    logical page: every layer's K and V for ``tokens_per_page`` tokens); block ``b`` is backed by
    the backend's physical pages ``layout.physical_pages([b])`` (``pages_per_block`` of them)."""

    def __init__(self, num_blocks: int, events: KVEventSink | None = None, block_size: int = 0,
                 medium: str = MEDIUM_DEVICE):
        """``events``: a sink told every change of the hash index; ``block_size`` (tokens per
        block) and ``medium`` (the tier) are what its events report."""
        if num_blocks <= 0:
            raise BlockStateError(f"a pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.events = events
        self.block_size = block_size
        self.medium = medium
        self._origin: dict[bytes, BlockOrigin] = {}  # hash -> what it was registered with
        # (chain parent, first token) -> {hash: the block's token ids}, oldest first
        self._continuations: dict[tuple[bytes, int], dict[bytes, tuple[int, ...]]] = {}
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self._clean = list(range(num_blocks))  # a heap: lowest id first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recent first
        self.evictions = 0
        self.backing = Backing(num_blocks)  # the memory behind each block, and its limit
        # told the cached blocks allocate hands out again, while their bytes are intact
        self.on_evict: Callable[[list[EvictedBlock]], None] | None = None

    # --- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: clean plus cached (evictable)."""
        return len(self._clean) + len(self._lru)

    @property
    def num_available(self) -> int:
        """Free blocks an allocation can take now: every free block but the clean ones without
        memory that the backing limit does not let it back."""
        return self.num_free - self.backing.unbackable(len(self._clean))

    @property
    def num_clean_available(self) -> int:
        """Clean blocks an allocation can take now (no cached block evicted)."""
        return len(self._clean) - self.backing.unbackable(len(self._clean))

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_clean(self) -> int:
        return len(self._clean)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def counters(self) -> PoolCounters:
        return PoolCounters(self.num_blocks, self.num_in_use, self.num_cached, self.num_clean,
                            self.evictions, self.backing.num_backed, self.backing.given_back,
                            self.backing.taken_again)

    def free_queue(self) -> list[int]:
        """Cached blocks in eviction order (next victim first)."""
        return list(self._lru)

    # --- allocation and references --------------------------------------------------------------
    def peek(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """The blocks ``allocate(n)`` would hand out, in order, changing nothing, so a caller can
        plan (map them, check every other limit) before taking them. Cached blocks in ``exclude``
        are skipped: the caller acquires them before allocating."""
        if self.backing.limited(n, len(self._clean)):
            blocks = self.backing.backable(self._clean, n)
        elif n == 1 and self._clean:
            return [self._clean[0]]
        elif n == 2 and len(self._clean) >= 2:  # a decode's block in each group of a two-group model
            return [self._clean[0], min(self._clean[1:3])]  # a heap's second smallest: a root's child
        else:  # pop and push back: O(n log N), where nsmallest would scan the whole heap
            blocks = [heapq.heappop(self._clean) for _ in range(min(n, len(self._clean)))]
            for block in blocks:
                heapq.heappush(self._clean, block)
        if len(blocks) < n:
            skip = set(exclude)
            victims = (block for block in self._lru if block not in skip)
            blocks += itertools.islice(victims, n - len(blocks))
        if len(blocks) < n:
            raise OutOfBlocksError(self._short_message(n))
        return blocks

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with ``ref = 1``: clean blocks first, then the least recently used
        cached blocks, whose hashes are dropped. Raises with no side effect when ``n`` don't fit."""
        backing = self.backing
        limited = backing.limited(n, len(self._clean))
        if n <= len(self._clean) and not limited:  # no eviction (a decode's one block per group)
            blocks = [heapq.heappop(self._clean) for _ in range(n)]
            for block in blocks:
                self.ref[block] = 1
                backing.back(block)
            return blocks
        if n > self.num_available:
            raise OutOfBlocksError(self._short_message(n))
        if limited:  # rare: only when a shared budget's share is short
            blocks = backing.backable(self._clean, n)
            taken = set(blocks)
            self._clean = [block for block in self._clean if block not in taken]
            heapq.heapify(self._clean)
        else:
            blocks = [heapq.heappop(self._clean) for _ in range(min(n, len(self._clean)))]
        for block in blocks:
            backing.back(block)
        evicted = []
        while len(blocks) < n:
            block, _ = self._lru.popitem(last=False)
            content_hash = self.hash_of[block]
            evicted.append(EvictedBlock(block, content_hash, self._forget(block)))
            blocks.append(block)
        for block in blocks:
            self.ref[block] = 1
        self.evictions += len(evicted)
        if evicted and self.events is not None:
            self.events(BlockRemoved([e.block_hash for e in evicted], self.medium))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return blocks

    def give_back_candidates(self, n: int) -> list[int]:
        """Up to ``n`` clean blocks with memory behind them, the last ones ``allocate`` would hand
        out first (highest id first), to give their memory back."""
        return self.backing.candidates(self._clean, n)

    def mark_given_back(self, blocks: list[int]) -> None:
        """The memory behind clean blocks ``blocks`` (``give_back_candidates``) went back to the OS."""
        state = self.backing.state
        for block in blocks:
            if self.ref[block] or self.hash_of[block] is not None or state[block] != BACKED:
                raise BlockStateError(f"block {block} is not a clean block with memory behind it")
        self.backing.mark_given_back(blocks)

    def evict_cached(self, n: int) -> int:
        """Drop the hashes of up to ``n`` least recently used cached blocks, which become clean
        (their memory can then be given back); told to the events sink and ``on_evict`` as an
        allocation's evictions are. Returns how many."""
        evicted = []
        while self._lru and len(evicted) < n:
            block, _ = self._lru.popitem(last=False)
            evicted.append(EvictedBlock(block, self.hash_of[block], self._forget(block)))
            heapq.heappush(self._clean, block)
            self.backing.cleaned()
        self.evictions += len(evicted)
        if evicted and self.events is not None:
            self.events(BlockRemoved([e.block_hash for e in evicted], self.medium))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return len(evicted)

    def _forget(self, block: int) -> BlockOrigin:
        content_hash = self.hash_of[block]
        del self.block_of_hash[content_hash]
        self.hash_of[block] = None
        origin = self._origin.pop(content_hash)
        key = self._continuation_key(origin)
        if key is not None:
            siblings = self._continuations[key]
            del siblings[content_hash]
            if not siblings:
                del self._continuations[key]
        return origin

    @staticmethod
    def _continuation_key(origin: BlockOrigin) -> tuple[bytes, int] | None:
        """Where a block's tokens sit in ``_continuations``: (chain parent, first token)."""
        chain_parent = origin.root if origin.parent_hash is None else origin.parent_hash
        if not origin.token_ids or chain_parent is None:
            return None
        return chain_parent, origin.token_ids[0]

    def take(self, planned: list[int]) -> list[int]:
        """Allocate the blocks an earlier ``peek`` planned; nothing may have changed the pool in
        between (a mismatch is a bug in the caller, and would map the wrong blocks)."""
        if not planned:
            return []
        blocks = self.allocate(len(planned))
        if blocks != planned:
            raise BlockStateError(f"planned blocks {planned} but allocate gave {blocks}: the pool "
                                 "changed between peek and take")
        return blocks

    def _short_message(self, n: int) -> str:
        waiting = self.backing.unbackable(len(self._clean))
        budget = (f", {waiting} of the clean ones without memory past this pool's share of the "
                  f"shared KV budget ({self.backing.limit} blocks)") if waiting else ""
        return (f"asked for {n} blocks, {self.num_free} free ({self.num_clean} clean + "
                f"{self.num_cached} cached{budget}) of {self.num_blocks}; free requests or enlarge "
                "the pool")

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork). A cached block leaves the
        free queue."""
        blocks = list(blocks)
        for block in blocks:
            self._check_block(block)
            if self.ref[block] == 0 and self.hash_of[block] is None:
                raise BlockStateError(f"block {block} is clean (free, no content); allocate it instead")
        for block in blocks:
            if self.ref[block] == 0:
                del self._lru[block]
            self.ref[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order. A block reaching zero joins the
        tail of the LRU queue if hashed (so earlier-released blocks are evicted first), else
        goes back to the clean blocks. A release below zero raises before anything changes."""
        blocks, ref, num_blocks = list(blocks), self.ref, self.num_blocks
        if len(set(blocks)) == len(blocks):  # each block once (a request's): one check a block
            for block in blocks:
                if not (0 <= block < num_blocks and ref[block]):
                    self._check_block(block)
                    raise BlockStateError(f"block {block} released 1 time(s) but holds 0 "
                                          "reference(s): double free")
        else:
            drops: dict[int, int] = {}
            for block in blocks:
                self._check_block(block)
                drops[block] = drops.get(block, 0) + 1
                if drops[block] > ref[block]:
                    raise BlockStateError(
                        f"block {block} released {drops[block]} time(s) but holds {ref[block]} "
                        "reference(s): double free")
        for block in blocks:
            ref[block] -= 1
            if ref[block] == 0:
                if self.hash_of[block] is None:
                    heapq.heappush(self._clean, block)
                    self.backing.cleaned()
                else:
                    self._lru[block] = None

    def refcount(self, block: int) -> int:
        return self.ref[block]

    # --- prefix-cache index --------------------------------------------------------------------
    def lookup(self, content_hash: bytes) -> int | None:
        return self.block_of_hash.get(content_hash)

    def register(self, block: int, content_hash: bytes, token_ids: Sequence[int] = (),
                 parent_hash: bytes | None = None, root: bytes | None = None) -> bool:
        """Record that an in-use, full block holds content ``content_hash``: its ``token_ids``,
        after the block hashed ``parent_hash`` (None for a prompt's first block, whose chain
        starts at ``root``, the hash of its cache keys). Returns False (and leaves the block
        unhashed) when another block already holds the same content; a hash newly registered is
        told to the events sink."""
        self._check_block(block)
        if self.ref[block] == 0:
            raise BlockStateError(f"block {block} is free; only an in-use block can be registered")
        if self.hash_of[block] is not None:
            if self.hash_of[block] != content_hash:
                raise BlockStateError(f"block {block} already holds other hashed content")
            return True
        if content_hash in self.block_of_hash:
            return False
        self.hash_of[block] = content_hash
        self.block_of_hash[content_hash] = block
        origin = BlockOrigin(tuple(token_ids), parent_hash, root if parent_hash is None else None)
        self._origin[content_hash] = origin
        key = self._continuation_key(origin)
        if key is not None:
            self._continuations.setdefault(key, {})[content_hash] = origin.token_ids
        if self.events is not None:
            self.events(BlockStored([content_hash], parent_hash, list(token_ids), self.block_size,
                                    None, self.medium))
        return True

    def shared_partial_tokens(self, chain_parent: bytes, token_ids: Sequence[int]) -> int:
        """The longest common prefix of ``token_ids`` (fewer than a block's worth: the part of a
        prompt past its page hits) with a hashed block that follows ``chain_parent`` (the last hit
        page's hash, or the chain's root). Compares with at most PARTIAL_MATCH_CANDIDATES blocks."""
        if not token_ids:
            return 0
        siblings = self._continuations.get((chain_parent, token_ids[0]))
        if not siblings:
            return 0
        best = 0
        for tokens in itertools.islice(reversed(siblings.values()), PARTIAL_MATCH_CANDIDATES):
            shared = 0
            for mine, theirs in zip(token_ids, tokens):
                if mine != theirs:
                    break
                shared += 1
            best = max(best, shared)
            if best == len(token_ids):
                break
        return best

    def reset_cache(self) -> int:
        """Forget every cached block's content (they become clean). Returns how many were dropped.
        Hashes of in-use blocks are dropped too, so no later request hits them."""
        dropped = len(self._lru)
        for block in self._lru:
            heapq.heappush(self._clean, block)
        self.backing.cleaned(dropped)
        self._lru.clear()
        self.block_of_hash.clear()
        self.hash_of = [None] * self.num_blocks
        self._origin.clear()
        self._continuations.clear()
        if self.events is not None:
            self.events(AllBlocksCleared())
        return dropped

    # --- invariants ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the pool's invariants; raises AssertionError naming the first one broken."""
        clean, cached = set(self._clean), set(self._lru)
        assert len(clean) == len(self._clean), "a block is twice in the clean heap"
        assert not clean & cached, f"blocks both clean and cached: {sorted(clean & cached)[:8]}"
        in_use = {p for p in range(self.num_blocks) if self.ref[p] > 0}
        assert not in_use & (clean | cached), "a block with ref > 0 is in a free queue"
        assert len(in_use) + len(cached) + len(clean) == self.num_blocks, (
            f"in use {len(in_use)} + cached {len(cached)} + clean {len(clean)} != {self.num_blocks}")
        assert all(r >= 0 for r in self.ref), "negative reference count"
        assert all(self.hash_of[p] is None for p in clean), "a clean block has a hash"
        assert all(self.hash_of[p] is not None for p in cached), "a cached block has no hash"
        self.backing.check(in_use | cached, clean)
        for h, p in self.block_of_hash.items():
            assert self.hash_of[p] == h, f"index says block {p} holds a hash it does not"
        hashed = sum(h is not None for h in self.hash_of)
        assert hashed == len(self.block_of_hash), "a hashed block is missing from the index"
        assert self._origin.keys() == self.block_of_hash.keys(), "origins differ from the hashes kept"
        kept = sum(self._continuation_key(origin) is not None for origin in self._origin.values())
        assert sum(map(len, self._continuations.values())) == kept, (
            "the continuation index and the origins differ")

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise BlockStateError(f"block {block} is outside the pool of {self.num_blocks} blocks")
