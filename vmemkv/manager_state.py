"""What every part of the KV cache manager shares: its parts, its requests, and the small steps
the operations are built from.

``KVCacheManager`` (``manager.py``) is this state plus three groups of operations, each in its own
module: the core (admit, allocate, commit, free, lookahead, queries) in ``manager.py``, sharing
(fork, reorder, truncate) in ``sharing.py``, preemption (estimate, preempt, swap in) in
``preemption.py``. Every mutating operation plans first (``pool.peek``, ``slots.choose``), asks the
one refusable step (``slots.map_jobs``), and only then changes anything (``pool.take``/``acquire``,
``slots.bind``, the request), so a refusal leaves nothing half done.

The parts (``pool``, ``slots``, ``backend``, ``swap``, ``hasher``, ``stats``) are attributes for
the manager's own modules, its tests and benchmarks; code that *uses* a manager (the engine, the
integrations) asks its public queries instead (``num_free_blocks``, ``blocks_for_tokens``,
``can_ever_fit``, ``cache_stats``, ...). ``layout`` is public and read-only: a frozen description
of where K and V sit, which attention needs anyway.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from . import validation as check
from .cache_config import CacheConfig, CacheStats
from .errors import ConfigError, ManagerClosedError, PageStateError, RequestTooLongError, VmemkvError
from .hashing import CacheKeys, PrefixHasher
from .kv_events import KVEventSink, check_sink
from .kv_metrics import KVMetricsCollector
from .layout import KVLayout
from .pool import BlockPool
from .slots import SlotMapper, SlotBinder
from .swap import SwapSpace
from .vmm import create_backend
from .vmm.base import VirtualMemoryBackend


class PrefixCacheBusyError(VmemkvError):
    """The prefix cache cannot be reset while requests hold blocks."""


class UnknownRequestError(VmemkvError, KeyError):
    """No request with this id is known to the manager (in that state)."""


@dataclass
class _Request:
    request_id: str
    keys: CacheKeys
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)  # one reference held on each
    num_tokens: int = 0  # positions reserved (written or about to be)
    num_computed: int = 0  # positions whose K/V is written
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks known so far
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    slot: int | None = None
    swapped: list[tuple[int, int]] | None = None  # (index in blocks, host block) while swapped


class ManagerState:
    """The manager's parts and requests, built from a :class:`CacheConfig`, and the invariant
    check over them."""

    config: CacheConfig
    tokens_per_page: int
    backend: VirtualMemoryBackend
    pool: BlockPool
    slots: SlotBinder  # SlotMapper for "vmem"
    hasher: PrefixHasher
    swap: SwapSpace
    stats: CacheStats
    metrics: KVMetricsCollector | None  # timing of operations and mapping (kv_metrics.py)

    def __init__(self, config: CacheConfig, backend: VirtualMemoryBackend | None = None,
                 metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None):
        self.config = check.config(config)
        if metrics is not None and not isinstance(metrics, KVMetricsCollector):
            raise ConfigError(f"metrics must be a vmemkv.KVMetricsCollector or None; got "
                              f"{type(metrics).__name__}")
        self.metrics = metrics
        self._layout = config.make_layout()
        self.tokens_per_page = self._layout.tokens_per_page
        pool_pages = config.num_blocks * self._layout.pages_per_block
        # On CPU, slots read in one batched call need filler pages past the pool (SlotMapper.
        # make_readable): one slot's worth, owned by no request, touched only where read.
        cpu_vmem = config.kv_backend == "vmem" and not str(config.device).startswith("cuda")
        filler = self._layout.slot_pages(config.max_model_len) if cpu_vmem else 0
        self.backend = backend or create_backend(config.device, self._layout.page_size, pool_pages + filler)
        if metrics is not None:  # the backend reports its map/unmap time to the same collector
            self.backend.metrics = metrics
        self.events = check_sink(events)  # told what enters and leaves the prefix cache
        self.pool = BlockPool(config.num_blocks, self.events, self.tokens_per_page)
        # "vmem": virtually contiguous slots; "paged": the block-table baseline (same pool, same
        # blocks, addressed through each request's block list; nothing is mapped). check.config
        # allowed only these two.
        addressing = {"vmem": SlotMapper, "paged": SlotBinder}[config.kv_backend]
        self.slots = addressing(self.backend, self._layout, config.max_num_seqs, config.max_model_len,
                                config.num_blocks)
        self.hasher = PrefixHasher(config.hash_algorithm, config.hash_seed)
        self._chain_root = functools.lru_cache(256)(self.hasher.root)  # keys -> root hash, 1 µs saved
        self.swap = SwapSpace(config.swap_space_bytes // self._layout.block_bytes,
                              self._layout.block_bytes,
                              pin_memory=str(config.device).startswith("cuda"))
        self.stats = CacheStats()
        self._requests: dict[str, _Request] = {}
        self._preempted: set[str] = set()  # recompute-preempted ids, to count their re-prefill
        self._closed = False

    @property
    def layout(self) -> KVLayout:
        """Where K and V sit in a slot and a block (frozen: read it, never replace it)."""
        return self._layout

    # --- invariants ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert DESIGN.md's invariants over the pool, the slots and every request."""
        self._check_open()
        self.pool.check()
        refs = np.zeros(self.pool.num_blocks, dtype=np.int64)
        bound = []
        writers: dict[int, str] = {}
        for req in self._requests.values():
            swapped = {i for i, _ in req.swapped} if req.swapped is not None else set()
            held = [b for i, b in enumerate(req.blocks) if i not in swapped]
            np.add.at(refs, np.asarray(held, dtype=np.int64), 1)
            assert req.num_computed <= req.num_tokens <= len(req.blocks) * self.tokens_per_page
            # Blocks past the reservation are lookahead: mapped early, private, unhashed (below).
            assert len(req.blocks) >= self._layout.logical_pages_for(req.num_tokens), (
                f"{req.request_id}: {len(req.blocks)} blocks for {req.num_tokens} tokens")
            assert req.swapped is None or len(req.blocks) == self._layout.logical_pages_for(req.num_tokens)
            if req.swapped is not None:
                assert req.slot is None
                continue
            bound.append(req.slot)
            self.slots.check_request(req.slot, req.blocks)
            for block in req.blocks[req.num_computed // self.tokens_per_page:]:  # writable pages
                assert self.pool.hash_of[block] is None, f"{req.request_id} can write hashed block {block}"
                assert self.pool.ref[block] == 1, f"{req.request_id} can write shared block {block}"
                assert block not in writers, f"block {block} writable by {writers.get(block)} and {req.request_id}"
                writers[block] = req.request_id
        assert np.array_equal(refs, np.asarray(self.pool.ref)), "reference counts differ from references held"
        assert len(set(bound)) == len(bound), "two requests share a slot"
        assert not set(bound) & set(self.slots.free_slots()), "a bound slot is also free"
        assert len(bound) + self.slots.num_free == self.slots.num_slots, "a slot was lost"
        swapped_host = sum(len(r.swapped) for r in self._requests.values() if r.swapped is not None)
        assert swapped_host + self.swap.num_free == self.swap.num_blocks, "swap space leaked"

    # --- looking requests up and checking arguments ----------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("this KV cache manager is closed; its memory is gone. "
                                     "Create a new one")

    def _running(self, request_id: str) -> _Request:
        req = self._requests.get(request_id) if type(request_id) is str else None
        if req is not None and req.swapped is None and not self._closed:  # the hot path
            return req
        req = self._known(request_id)
        if req.swapped is not None:
            raise UnknownRequestError(f"request {request_id!r} is swapped out, not running; "
                                      "swap_in() it first")
        return req

    def _known(self, request_id: str) -> _Request:
        """A running or swapped request (UnknownRequestError otherwise)."""
        if self._closed:
            self._check_open()
        if type(request_id) is not str:
            check.request_id(request_id)
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"no request {request_id!r}; admit() it first")
        return req

    def _token_ids(self, token_ids, what: str) -> list[int]:
        return check.token_ids(token_ids, what, self.config.vocab_size)

    def _check_length(self, request_id: str, num_tokens: int) -> None:
        if num_tokens > self.config.max_model_len:
            raise RequestTooLongError(
                f"request {request_id!r} needs {num_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}; shorten it or raise max_model_len")

    def _slot_available(self, slot: int | None) -> bool:
        return self.slots.num_free > 0 if slot is None else self.slots.is_free(slot)

    def _require_committed(self, req: _Request) -> None:
        if req.num_computed != req.num_tokens:
            raise PageStateError(
                f"request {req.request_id!r} has {req.num_tokens - req.num_computed} reserved "
                "tokens not yet computed; commit() them first")

    # --- steps the operations share --------------------------------------------------------------
    def _blocks_needed(self, req: _Request, num_new_tokens: int) -> int:
        """New blocks for ``num_new_tokens`` more positions (lookahead blocks count as held)."""
        return max(-(-(req.num_tokens + num_new_tokens) // self.tokens_per_page) - len(req.blocks), 0)

    def _fits_admission(self, hits: list[int], total: int) -> bool:
        needed = self._layout.logical_pages_for(total) - len(hits)
        revived = sum(self.pool.ref[b] == 0 for b in hits)  # taken out of the free queue first
        return needed <= self.pool.num_free - revived

    def _grow(self, req: _Request, num_new_tokens: int) -> None:
        """Reserve positions, mapping the pages they reach first (the one step that can be
        refused). Lookahead blocks are normally mapped already; one whose background mapping
        was refused is mapped here, so no position is ever written through a stale mapping."""
        tokens_per_page = self.tokens_per_page
        first = -(-req.num_tokens // tokens_per_page)
        end = -(-(req.num_tokens + num_new_tokens) // tokens_per_page)
        if end > first:
            fresh = self.pool.peek(end - len(req.blocks)) if end > len(req.blocks) else []
            self.slots.map_blocks(req.slot, first, req.blocks[first:end] + fresh,
                                  keep=len(req.blocks))
            if fresh:
                req.blocks += self.pool.take(fresh)
        req.num_tokens += num_new_tokens

    def _register(self, req: _Request, index: int) -> None:
        """Offer full block ``index`` of ``req`` to the prefix cache, with its tokens and parent
        (for KV events and the partial-page hit count)."""
        tokens = req.token_ids[index * self.tokens_per_page:(index + 1) * self.tokens_per_page]
        parent = req.hashes[index - 1] if index else None
        self.pool.register(req.blocks[index], req.hashes[index], tokens, parent,
                           None if index else self._chain_root(req.keys))

    def _reserved_blocks(self, req: _Request) -> list[int]:
        """The request's blocks without lookahead ones."""
        return req.blocks[: self._layout.logical_pages_for(req.num_tokens)]

    def _trim_lookahead(self, req: _Request) -> None:
        """Release blocks past the reservation (given early by allocate_lookahead)."""
        needed = self._layout.logical_pages_for(req.num_tokens)
        if len(req.blocks) > needed:
            self.pool.release(reversed(req.blocks[needed:]))
            del req.blocks[needed:]

    def _copy_of(self, source: int, copy: int) -> int:
        """Copy block ``source``'s bytes onto ``copy`` (just taken); returns ``copy``."""
        self.backend.copy_pages(self._layout.physical_pages(np.array([source])).tolist(),
                                self._layout.physical_pages(np.array([copy])).tolist())
        self.stats.pages_copied += 1
        return copy

    def _block_window(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` uint8 rows."""
        pages = self.pool.num_blocks * self._layout.pages_per_block  # filler pages may follow
        return self.backend.pool_window()[:pages].view(self.pool.num_blocks, self._layout.block_bytes)
