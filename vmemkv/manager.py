"""The scheduler-facing KV cache manager.

Each running request is bound to a slot and owns one reference on each block (logical page) of
its KV. The manager is mechanism only: it answers "can this fit?" with no side effects, and does
what it is told (admit, allocate, commit, fork, reorder, free, preempt, swap in). Whom to preempt
and when is the scheduler's business.

Life of a request::

    cached = manager.admit("r1", prompt_ids)      # binds a slot, maps prefix hits, reserves the rest
    ... forward pass writes K/V for positions [cached, len(prompt_ids)) through kv_views() ...
    manager.commit("r1")                          # computed; full pages join the prefix cache
    manager.allocate("r1", 1, [next_token])       # decode: a new page only at a page boundary
    ...
    manager.free("r1")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

from . import validation as check
from .errors import (ConfigError, ManagerClosedError, PageStateError, RequestTooLongError,
                     VmemkvError)
from .hashing import CacheKeys, PrefixHasher
from .layout import KVLayout, LayoutKind, choose_page, unpadded_row_bytes
from .pool import PagePool
from .slots import MapJob, NoFreeSlotError, SlotMapper, SlotTable
from .swap import OutOfSwapSpaceError, SwapSpace
from .vmm import create_backend
from .vmm.base import VirtualMemoryBackend

CUDA_GRANULARITY = 2 << 20


class PrefixCacheBusyError(VmemkvError):
    """The prefix cache cannot be reset while requests hold pages."""


class UnknownRequestError(VmemkvError, KeyError):
    """No request with this id is known to the manager (in that state)."""


@dataclass
class CacheConfig:
    """What the manager holds, and how pages are sized.

    Page sizing: ``page_size`` (bytes) when given is used as is, unpadded. Otherwise vmemkv
    chooses the page (a multiple of ``page_granularity``: 2 MiB on CUDA, 4 KiB on CPU unless set)
    and may pad each token's row by up to ``max_padding`` of its size, to give the fewest tokens
    per page, at least ``tokens_per_page``, in a page of at most ``max_page_bytes`` and never more
    than 512 tokens where the shape allows (``layout.choose_page``). Raising ``max_padding``
    trades memory for finer pages; 0 never pads. The result is ``make_layout().describe()``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # logical pages in the pool
    max_num_seqs: int  # slots
    max_model_len: int  # tokens each slot can hold
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    tokens_per_page: int = 16  # the fewest tokens a page should hold (see above)
    page_size: int | None = None  # bytes; chosen when None (see above)
    max_padding: float = 0.07  # padding per token row, as a fraction of the row's own bytes
    max_page_bytes: int = 16 << 20  # pages above this only when no padding within limits allows
    page_granularity: int | None = None  # bytes; the device's when None (2 MiB pages on CPU too)
    layout: LayoutKind = "token_major"
    kv_backend: Literal["vmem", "paged"] = "vmem"
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"
    hash_seed: bytes | None = None  # random per process when None
    swap_space_bytes: int = 0
    # Rates for the swap-or-recompute estimate; measure them on your machine for better choices.
    swap_bytes_per_second: float = 10e9
    prefill_tokens_per_second: float = 10e3
    vocab_size: int | None = None  # when known, token ids are checked against it

    def make_layout(self) -> KVLayout:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        if self.page_size:
            return KVLayout(*shape, self.page_size, self.layout)
        device_granularity = CUDA_GRANULARITY if str(self.device).startswith("cuda") else 4096
        granularity = self.page_granularity or device_granularity
        if not isinstance(granularity, int) or granularity % device_granularity:
            raise ConfigError(f"CacheConfig.page_granularity is {granularity!r}; pass a multiple of "
                              f"{device_granularity} B (the {self.device} mapping granularity)")
        choice = choose_page(unpadded_row_bytes(*shape, self.layout), granularity,
                             self.tokens_per_page, self.max_padding, self.max_page_bytes)
        return KVLayout(*shape, choice.page_size, self.layout, choice.token_stride_bytes)


@dataclass
class CacheStats:
    prefix_queried_tokens: int = 0  # prompt tokens looked up at first admission
    prefix_hit_tokens: int = 0
    reprefill_queried_tokens: int = 0  # the same, for re-admission after preemption
    reprefill_hit_tokens: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    forks: int = 0
    pages_copied: int = 0  # copy-on-write copies of partial pages

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


@dataclass
class PreemptionEstimate:
    """What each way of preempting a request would cost.

    swap: ``2 * swap_bytes / swap_bytes_per_second`` (out now, in later);
    recompute: ``recompute_tokens / prefill_tokens_per_second``, where ``recompute_tokens`` are the
    computed tokens not covered by pages that other requests keep alive (those will still hit).
    Swap is chosen only when it is cheaper and the swap space has room.
    """

    swap_bytes: int
    recompute_tokens: int
    swap_seconds: float
    recompute_seconds: float
    swap_fits: bool

    @property
    def cheaper(self) -> Literal["swap", "recompute"]:
        return "swap" if self.swap_fits and self.swap_seconds < self.recompute_seconds else "recompute"


@dataclass
class _Request:
    request_id: str
    keys: CacheKeys
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)  # one reference held on each
    num_tokens: int = 0  # positions reserved (written or about to be)
    num_computed: int = 0  # positions whose K/V is written
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of full pages known so far
    num_registered: int = 0  # leading full pages already offered to the prefix cache
    slot: int | None = None
    swapped: list[tuple[int, int]] | None = None  # (index in blocks, host block) while swapped


class KVCacheManager:
    def __init__(self, config: CacheConfig, backend: VirtualMemoryBackend | None = None):
        self.config = check.config(config)
        self.layout = config.make_layout()
        self.tokens_per_page = self.layout.tokens_per_page
        if config.max_model_len <= 0 or config.max_num_seqs <= 0:
            raise ConfigError("max_model_len and max_num_seqs must be positive")
        pool_pages = config.num_blocks * self.layout.pages_per_block
        # On CPU, slots read in one batched call need filler pages past the pool (SlotMapper.
        # make_readable): one slot's worth, owned by no request, touched only where read.
        cpu_vmem = config.kv_backend == "vmem" and not str(config.device).startswith("cuda")
        filler = self.layout.slot_pages(config.max_model_len) if cpu_vmem else 0
        self.backend = backend or create_backend(config.device, self.layout.page_size, pool_pages + filler)
        self.pool = PagePool(config.num_blocks)
        # "vmem": virtually contiguous slots; "paged": the block-table baseline (same pool, same
        # pages, addressed through each request's block list; nothing is mapped).
        addressing = {"vmem": SlotMapper, "paged": SlotTable}.get(config.kv_backend)
        if addressing is None:
            raise ConfigError(f"kv_backend must be 'vmem' or 'paged', got {config.kv_backend!r}")
        self.slots = addressing(self.backend, self.layout, config.max_num_seqs, config.max_model_len,
                                config.num_blocks)
        self.hasher = PrefixHasher(config.hash_algorithm, config.hash_seed)
        self.swap = SwapSpace(config.swap_space_bytes // self.layout.block_bytes,
                              self.layout.block_bytes,
                              pin_memory=str(config.device).startswith("cuda"))
        self.stats = CacheStats()
        self._requests: dict[str, _Request] = {}
        self._preempted: set[str] = set()  # recompute-preempted ids, to count their re-prefill
        self._closed = False

    # --- queries without side effects ----------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        self._check_open()
        return self.slots.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        self._check_open()
        return self.pool.num_in_use / self.pool.num_pages

    def match_prefix(self, token_ids: Sequence[int], keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of ``token_ids`` (whole pages, leaving at least one
        token to compute) and the hashes of all full pages of ``token_ids``."""
        self._check_open()
        if not self.config.enable_prefix_caching:
            return [], []
        hashes = self.hasher.page_hashes(self._token_ids(token_ids, "token_ids"), self.tokens_per_page,
                                         check.cache_keys(keys))
        hits = []
        for h in hashes[: (len(token_ids) - 1) // self.tokens_per_page]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, hashes

    def can_admit(self, token_ids: Sequence[int], keys: CacheKeys = CacheKeys()) -> bool:
        """Whether ``admit`` of all of ``token_ids`` would succeed now."""
        self._check_open()
        hits, _ = self.match_prefix(token_ids, keys)
        return self.slots.num_free > 0 and self._fits_admission(hits, len(token_ids))

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        req = self._running(request_id)
        return self._blocks_needed(req, check.count(num_new_tokens, "num_new_tokens")) <= self.pool.num_free

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        req = self._running(request_id)
        return self._blocks_needed(req, check.count(num_new_tokens, "num_new_tokens"))

    # --- admission and growth ------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int | None = None,
              keys: CacheKeys = CacheKeys(), token_budget: int | None = None,
              slot: int | None = None) -> int | None:
        """Bind a request to a slot (``slot`` when given), map its cached prefix, and reserve
        positions for ``num_new_tokens`` more tokens (default: the rest of ``token_ids``; at most
        ``token_budget``, for chunked prefill). Returns how many tokens are already computed, or
        None, changing nothing, when no slot (or not ``slot``) or not enough blocks are free."""
        self._check_open()
        request_id = check.request_id(request_id)
        token_ids = self._token_ids(token_ids, "token_ids")
        keys = check.cache_keys(keys)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens", optional=True)
        token_budget = check.count(token_budget, "token_budget", optional=True)
        slot = check.slot_index(slot, self.slots.num_slots)
        if request_id in self._requests:
            raise PageStateError(f"request {request_id!r} is already admitted")
        self._check_length(request_id, len(token_ids))
        hits, hashes = self.match_prefix(token_ids, keys)
        cached = len(hits) * self.tokens_per_page
        new = len(token_ids) - cached if num_new_tokens is None else num_new_tokens
        if token_budget is not None:
            new = min(new, token_budget)
        self._check_length(request_id, cached + new)
        if not self._slot_available(slot) or not self._fits_admission(hits, cached + new):
            return None
        # Plan (slot, pages), map (the one step the mapping budget can refuse), then take.
        fresh = self.pool.peek(self.layout.logical_pages_for(cached + new) - len(hits), exclude=hits)
        slot = self.slots.choose(hits[0] if hits else None, slot)
        self.slots.map_jobs([MapJob(slot, 0, hits + fresh)])
        self.slots.bind(slot=slot)
        self.pool.acquire(hits)
        req = _Request(request_id, keys, list(token_ids), blocks=hits + self.pool.take(fresh),
                       num_tokens=cached + new, num_computed=cached, hashes=hashes,
                       num_registered=len(hits), slot=slot)
        self._requests[request_id] = req
        repeat = request_id in self._preempted
        self._preempted.discard(request_id)
        if self.config.enable_prefix_caching:
            if repeat:
                self.stats.reprefill_queried_tokens += len(token_ids)
                self.stats.reprefill_hit_tokens += cached
            else:
                self.stats.prefix_queried_tokens += len(token_ids)
                self.stats.prefix_hit_tokens += cached
        return cached

    def allocate(self, request_id: str, num_new_tokens: int, new_token_ids: Sequence[int] = ()) -> bool:
        """Reserve ``num_new_tokens`` more positions (mapping a block only when crossing a page
        boundary), recording ``new_token_ids`` as the request's next tokens. Returns False,
        changing nothing, when the blocks are not there."""
        req = self._running(request_id)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        new_token_ids = self._token_ids(new_token_ids, "new_token_ids")
        self._check_length(request_id, req.num_tokens + num_new_tokens)
        if self._blocks_needed(req, num_new_tokens) > self.pool.num_free:
            return False
        self._grow(req, num_new_tokens)
        req.token_ids.extend(new_token_ids)
        return True

    def commit(self, request_id: str, num_computed_tokens: int | None = None) -> None:
        """Mark positions up to ``num_computed_tokens`` (default: all reserved) as written. Pages
        that are now full join the prefix cache and are never written again."""
        req = self._running(request_id)
        done = req.num_tokens if num_computed_tokens is None else check.count(
            num_computed_tokens, "num_computed_tokens")
        if not req.num_computed <= done <= min(req.num_tokens, len(req.token_ids)):
            raise PageStateError(
                f"request {request_id!r}: cannot mark {done} tokens computed; it has "
                f"{req.num_computed} computed, {req.num_tokens} reserved, {len(req.token_ids)} known")
        req.num_computed = done
        full = done // self.tokens_per_page
        if not self.config.enable_prefix_caching or full <= req.num_registered:
            return
        if full > len(req.hashes):
            parent = req.hashes[-1] if req.hashes else None
            req.hashes += self.hasher.page_hashes(req.token_ids, self.tokens_per_page, req.keys,
                                                  start_page=len(req.hashes), parent=parent,
                                                  end_page=full)
        for index in range(req.num_registered, full):
            if self.pool.hash_of[req.blocks[index]] is None:
                self.pool.register(req.blocks[index], req.hashes[index])
        req.num_registered = full

    def truncate(self, request_id: str, num_tokens: int) -> bool:
        """Forget every position from ``num_tokens`` on (rejected speculative tokens, a cropped
        cache). Pages past the new end are released; if the new last page is partial and shared
        or cached, it is copied to a private page first, since the request will write it again.
        Returns False, changing nothing, when that copy finds no free block."""
        req = self._running(request_id)
        self._require_committed(req)
        num_tokens = check.count(num_tokens, "num_tokens")
        if not num_tokens <= req.num_tokens:
            raise PageStateError(f"request {request_id!r} has {req.num_tokens} tokens; cannot "
                                 f"truncate it to {num_tokens}")
        keep = self.layout.logical_pages_for(num_tokens)
        last = req.blocks[keep - 1] if keep and num_tokens % self.tokens_per_page else None
        private = last is None or (self.pool.ref[last] == 1 and self.pool.hash_of[last] is None)
        if not private:
            if not self.pool.num_free:
                return False
            copy = self.pool.peek(1)
            self.slots.map_blocks(req.slot, keep - 1, copy, keep=len(req.blocks))
            req.blocks[keep - 1] = self._copy_of(last, self.pool.take(copy)[0])
            self.pool.release([last])
        self.pool.release(reversed(req.blocks[keep:]))
        del req.blocks[keep:]
        full = num_tokens // self.tokens_per_page
        del req.token_ids[num_tokens:]
        del req.hashes[full:]
        req.num_registered = min(req.num_registered, full)
        req.num_tokens = req.num_computed = num_tokens
        return True

    # --- overlapped mapping ---------------------------------------------------------------------
    def allocate_lookahead(self, request_ids: Sequence[str], margin_tokens: int,
                           keep_free: int = 0) -> list[MapJob]:
        """Give each request whose reservation ends within ``margin_tokens`` of its last block's
        end the blocks that cover ``margin_tokens`` more positions (never past ``max_model_len``)
        now, without mapping them, while more than ``keep_free`` blocks stay free. Only clean
        blocks are taken, so no cached prefix is evicted for a guess. Returns the jobs for
        ``map_lookahead``, which may run on another thread while the device computes: it touches
        only mapping state, and only pages past every reserved position."""
        self._check_open()
        margin_tokens = check.count(margin_tokens, "margin_tokens")
        keep_free = check.count(keep_free, "keep_free")
        running = [self._running(r) for r in check.request_id_list(request_ids, "request_ids")]
        jobs = []
        for req in running:
            end = min(req.num_tokens + margin_tokens, self.config.max_model_len)
            needed = self.layout.logical_pages_for(end) - len(req.blocks)
            if needed <= 0 or needed > self.pool.num_clean or self.pool.num_free - needed < keep_free:
                continue
            first = len(req.blocks)
            new = self.pool.allocate(needed)
            req.blocks += new
            jobs.append(MapJob(req.slot, first, new))
        return jobs

    def map_lookahead(self, jobs: list[MapJob]) -> None:
        """Map the jobs of ``allocate_lookahead``, all or none. If this raises, call
        ``cancel_lookahead(jobs)`` on the step thread before the requests grow again."""
        self.slots.map_jobs(jobs)

    def cancel_lookahead(self, jobs: list[MapJob]) -> None:
        """Give back the blocks of lookahead jobs whose mapping was refused; call it right after
        ``map_lookahead`` raised, before the requests change."""
        by_slot = {req.slot: req for req in self._requests.values() if req.swapped is None}
        for job in jobs:
            req = by_slot.get(job.slot)
            if req is None or req.blocks[job.first:] != job.blocks:
                raise PageStateError(f"lookahead job {job} is not the tail of its request's "
                                     "blocks any more; cancel right after map_lookahead raised")
            self.pool.release(reversed(job.blocks))
            del req.blocks[job.first:]

    def _trim_lookahead(self, req: _Request) -> None:
        """Release blocks past the reservation (given early by allocate_lookahead)."""
        needed = self.layout.logical_pages_for(req.num_tokens)
        if len(req.blocks) > needed:
            self.pool.release(reversed(req.blocks[needed:]))
            del req.blocks[needed:]

    # --- copy-on-write -------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str, slot: int | None = None) -> bool:
        """Start ``child_id`` as a copy of ``parent_id`` in another slot (``slot`` when given):
        full pages shared, the partial last page copied. Returns False, changing nothing, without
        a slot (or not ``slot``) or a block."""
        parent = self._running(parent_id)
        child_id = check.request_id(child_id, "child_id")
        slot = check.slot_index(slot, self.slots.num_slots)
        if child_id in self._requests:
            raise PageStateError(f"request {child_id!r} already exists")
        self._require_committed(parent)
        partial = parent.num_tokens % self.tokens_per_page != 0
        if not self._slot_available(slot) or (partial and not self.pool.num_free):
            return False
        reserved = self._reserved_blocks(parent)
        shared = reserved[:-1] if partial else reserved
        copy = self.pool.peek(1) if partial else []
        slot = self.slots.choose(reserved[0] if reserved else None, slot)
        self.slots.map_jobs([MapJob(slot, 0, shared + copy)])
        self.slots.bind(slot=slot)
        self.pool.acquire(shared)
        if partial:
            copy = [self._copy_of(reserved[-1], *self.pool.take(copy))]
        self._requests[child_id] = _Request(
            child_id, parent.keys, list(parent.token_ids), blocks=shared + copy,
            num_tokens=parent.num_tokens, num_computed=parent.num_computed,
            hashes=list(parent.hashes), num_registered=parent.num_registered, slot=slot)
        self.stats.forks += 1
        return True

    def reorder(self, request_ids: Sequence[str], source_ids: Sequence[str]) -> bool:
        """Beam-search reorder: request ``request_ids[i]`` becomes a copy of ``source_ids[i]``
        (as they were before the call). Full pages are remapped, never copied; a partial page is
        copied only when more than one request takes it. Returns False, changing nothing, when
        the copies need more free blocks than there are."""
        rows = [self._running(r) for r in check.request_id_list(request_ids, "request_ids")]
        sources = [self._running(s) for s in check.request_id_list(source_ids, "source_ids")]
        if len(rows) != len(sources) or len({id(row) for row in rows}) != len(rows):
            raise PageStateError(f"reorder needs distinct requests, one source each; got "
                                 f"{list(request_ids)} from {list(source_ids)}")
        for source in sources:
            self._require_committed(source)
        # A source's partial page moves (no copy) to the first row that takes it, itself first,
        # but only when the source is reordered too (its own reference is dropped below): a
        # source that keeps running keeps writing that page, so whoever takes it gets a copy.
        owner: dict[str, int] = {}
        for i, (row, source) in enumerate(zip(rows, sources)):
            if row is source:
                owner[source.request_id] = i
        reordered = {id(row) for row in rows}
        for i, source in enumerate(sources):
            if id(source) in reordered:
                owner.setdefault(source.request_id, i)
        copied = [s.num_tokens % self.tokens_per_page != 0 and owner.get(s.request_id) != i
                  for i, s in enumerate(sources)]
        if sum(copied) > self.pool.num_free:
            return False
        # Plan every row's blocks, map all rows at once (refusable), then move the references.
        fresh = iter(self.pool.peek(sum(copied)))
        reserved = [self._reserved_blocks(s) for s in sources]
        plans = [blocks[:-1] + [next(fresh)] if copy else list(blocks)
                 for blocks, copy in zip(reserved, copied)]
        self.slots.map_jobs([MapJob(row.slot, 0, blocks, keep=len(row.blocks))
                             for row, blocks in zip(rows, plans)])
        snapshots = [(list(s.token_ids), s.num_tokens, s.num_computed, list(s.hashes),
                      s.num_registered, s.keys) for s in sources]
        self.pool.take([blocks[-1] for blocks, copy in zip(plans, copied) if copy])
        for blocks, source_blocks, copy in zip(plans, reserved, copied):
            self.pool.acquire(blocks[:-1] if copy else blocks)
            if copy:
                self._copy_of(source_blocks[-1], blocks[-1])
        for row in rows:  # their old blocks, lookahead included
            self.pool.release(reversed(row.blocks))
        for row, blocks, (tokens, num_tokens, num_computed, hashes, registered, keys) in zip(
                rows, plans, snapshots):
            # the keys travel with the content: later page hashes continue the source's chain
            row.keys, row.blocks, row.token_ids, row.num_tokens = keys, blocks, tokens, num_tokens
            row.num_computed, row.hashes, row.num_registered = num_computed, hashes, registered
        return True

    # --- freeing and preemption ----------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release a request (running or swapped). Its blocks go back deepest first, so a shared
        prefix outlives its tails in the LRU queue; its slot keeps its mappings."""
        self._check_open()
        req = self._requests.pop(check.request_id(request_id), None)
        if req is None:
            raise UnknownRequestError(f"no request {request_id!r} to free")
        self._preempted.discard(request_id)
        if req.swapped is not None:
            swapped = {index for index, _ in req.swapped}
            self.swap.discard([host for _, host in req.swapped])
            kept = [b for i, b in enumerate(req.blocks) if i not in swapped]
            self.pool.release(reversed(kept))
            return
        self.pool.release(reversed(req.blocks))
        self.slots.release(req.slot)

    def discard(self, request_id: str) -> None:
        """Forget a request for good, in whatever state it is (an abort): free what it holds;
        a request preempted by recompute holds nothing and is just forgotten; an unknown id is
        ignored."""
        self._check_open()
        request_id = check.request_id(request_id)
        self._preempted.discard(request_id)
        if request_id in self._requests:
            self.free(request_id)

    def estimate_preemption(self, request_id: str) -> PreemptionEstimate:
        req = self._running(request_id)
        private = [b for b in self._reserved_blocks(req) if self.pool.ref[b] == 1]
        swap_bytes = len(private) * self.layout.block_bytes
        surviving = 0
        for block in req.blocks:  # a prefix kept alive by other requests will hit again
            if self.pool.ref[block] > 1 and self.pool.hash_of[block] is not None:
                surviving += self.tokens_per_page
            else:
                break
        recompute = max(req.num_computed - surviving, 0)
        return PreemptionEstimate(
            swap_bytes, recompute, 2 * swap_bytes / self.config.swap_bytes_per_second,
            recompute / self.config.prefill_tokens_per_second, len(private) <= self.swap.num_free)

    def preempt(self, request_id: str, mode: Literal["recompute", "swap", "auto"] = "auto") -> str:
        """Take a running request off the device; returns the mode used.

        recompute: its blocks are released (cached ones may be hit when it is admitted again with
        all its tokens). swap: its private blocks are copied to host swap space and released;
        blocks shared with other requests stay referenced; ``swap_in`` brings it back."""
        req = self._running(request_id)
        self._require_committed(req)
        mode = check.choice(mode, "preemption mode", check.PREEMPT_MODES)
        if mode == "auto":
            mode = self.estimate_preemption(request_id).cheaper
        if mode == "recompute":
            self.free(request_id)
            self._preempted.add(request_id)
            self.stats.preemptions_recompute += 1
            return mode
        private = [i for i, b in enumerate(self._reserved_blocks(req)) if self.pool.ref[b] == 1]
        self.swap.check_room(len(private))
        self._trim_lookahead(req)
        host = self.swap.store(self._block_window(), [req.blocks[i] for i in private])
        self.pool.release(reversed([req.blocks[i] for i in private]))
        req.swapped = list(zip(private, host))
        self.slots.release(req.slot)
        req.slot = None
        self.stats.preemptions_swap += 1
        self.stats.swap_out_bytes += len(private) * self.layout.block_bytes
        return mode

    def swap_in(self, request_id: str) -> bool:
        """Bring a swapped request back into any free slot, bit-exact. Returns False, changing
        nothing, without a free slot or enough blocks."""
        self._check_open()
        req = self._requests.get(check.request_id(request_id))
        if req is None or req.swapped is None:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        revive = {}  # swapped full pages still in the prefix cache are taken, not copied back
        for index, _ in req.swapped:
            if index < req.num_registered:
                block = self.pool.lookup(req.hashes[index])
                if block is not None:
                    revive[index] = block
        revived_cached = sum(self.pool.ref[b] == 0 for b in revive.values())
        needed = len(req.swapped) - len(revive)
        if not self.slots.num_free or needed > self.pool.num_free - revived_cached:
            return False
        copy = [(index, host) for index, host in req.swapped if index not in revive]
        fresh = self.pool.peek(len(copy), exclude=revive.values())
        blocks = list(req.blocks)
        for (index, _), block in zip(copy, fresh):
            blocks[index] = block
        for index, block in revive.items():
            blocks[index] = block
        slot = self.slots.choose(blocks[0] if blocks else None)
        self.slots.map_jobs([MapJob(slot, 0, blocks)])  # refused: the request stays swapped
        self.slots.bind(slot=slot)
        self.pool.acquire(revive.values())
        self.pool.take(fresh)
        self.swap.load(self._block_window(), [host for _, host in copy], fresh)
        self.swap.discard([host for index, host in req.swapped if index in revive])
        req.blocks = blocks
        for index, block in zip(range(req.num_registered), req.blocks):
            if self.pool.hash_of[block] is None:
                self.pool.register(block, req.hashes[index])
        req.swapped = None
        req.slot = slot
        self.stats.swap_in_bytes += len(copy) * self.layout.block_bytes
        return True

    def reset_prefix_cache(self) -> int:
        """Forget all cached content. Refused while any request holds blocks (their hashes would
        go stale mid-flight). Returns how many cached blocks were dropped."""
        self._check_open()
        if self.pool.num_in_use:
            raise PrefixCacheBusyError(
                f"cannot reset the prefix cache: {self.pool.num_in_use} blocks are held by "
                f"{len(self._requests)} request(s); free or finish them first")
        return self.pool.reset_cache()

    # --- what attention and the engine read ---------------------------------------------------
    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V over every slot, ``[num_slots, max_model_len, kv_heads, dim]``
        (vmem only). Touch only positions below a request's reservation."""
        self._check_open()
        return self.slots.kv_views(check.layer_index(layer, self.layout.num_layers))

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as block tensors ``[num_blocks, tokens_per_page, kv_heads,
        dim]``, addressed through ``block_table(request_id)`` (both backends)."""
        self._check_open()
        return self.slots.block_views(check.layer_index(layer, self.layout.num_layers))

    def slot_of(self, request_id: str) -> int:
        return self._running(request_id).slot

    def num_tokens(self, request_id: str) -> int:
        return self._running(request_id).num_tokens

    def num_computed_tokens(self, request_id: str) -> int:
        return self._known(request_id).num_computed

    def block_table(self, request_id: str) -> list[int]:
        return list(self._running(request_id).blocks)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._known(request_id).token_ids)

    def is_swapped(self, request_id: str) -> bool:
        self._check_open()
        req = self._requests.get(check.request_id(request_id))
        return req is not None and req.swapped is not None

    def request_ids(self) -> list[str]:
        self._check_open()
        return list(self._requests)

    def snapshot_stats(self) -> dict:
        self._check_open()
        pool = self.pool.counters()
        slots = self.slots.stats
        return {
            **{k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__},
            "prefix_hit_rate": self.stats.prefix_hit_rate,
            "usage": self.usage(),
            "blocks_total": pool.num_pages, "blocks_in_use": pool.in_use,
            "blocks_cached": pool.cached, "blocks_clean": pool.clean, "evictions": pool.evictions,
            "map_calls": slots.map_calls, "pages_mapped": slots.pages_mapped,
            "map_calls_saved": slots.pages_already_mapped, "unmap_calls": slots.unmap_calls,
            "pages_unmapped": slots.pages_unmapped,
            "tokens_per_page": self.tokens_per_page, "page_bytes": self.layout.page_size,
            "padding_fraction": self.layout.padding_fraction,
        }

    # --- invariants ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert DESIGN.md's invariants over the pool, the slots and every request."""
        self._check_open()
        self.pool.check()
        refs = np.zeros(self.pool.num_pages, dtype=np.int64)
        bound = []
        writers: dict[int, str] = {}
        for req in self._requests.values():
            swapped = {i for i, _ in req.swapped} if req.swapped is not None else set()
            held = [b for i, b in enumerate(req.blocks) if i not in swapped]
            np.add.at(refs, np.asarray(held, dtype=np.int64), 1)
            assert req.num_computed <= req.num_tokens <= len(req.blocks) * self.tokens_per_page
            # Blocks past the reservation are lookahead: mapped early, private, unhashed (below).
            assert len(req.blocks) >= self.layout.logical_pages_for(req.num_tokens), (
                f"{req.request_id}: {len(req.blocks)} blocks for {req.num_tokens} tokens")
            assert req.swapped is None or len(req.blocks) == self.layout.logical_pages_for(req.num_tokens)
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

    def close(self) -> None:
        """Give the memory back; every later call raises ManagerClosedError. Refused while
        tensors viewing the memory (from kv_views/block_views) are still held: reading one
        after close would crash the process. Closing twice does nothing."""
        if self._closed:
            return
        held = self.slots.views_in_use()
        if held:
            raise ManagerClosedError(
                f"cannot close the KV cache manager: {held} reference(s) to its K/V views (from "
                "kv_views/block_views, or tensors and arrays made from them) are still held; "
                "drop them first, since reading them after close would crash the process")
        self._closed = True
        self.slots.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.slots.views_in_use():
            return  # closing would raise and hide the error in flight; the views stay readable
        self.close()

    # --- internals --------------------------------------------------------------------------------
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

    def _blocks_needed(self, req: _Request, num_new_tokens: int) -> int:
        """New blocks for ``num_new_tokens`` more positions (lookahead blocks count as held)."""
        return max(-(-(req.num_tokens + num_new_tokens) // self.tokens_per_page) - len(req.blocks), 0)

    def _fits_admission(self, hits: list[int], total: int) -> bool:
        needed = self.layout.logical_pages_for(total) - len(hits)
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

    def _reserved_blocks(self, req: _Request) -> list[int]:
        """The request's blocks without lookahead ones."""
        return req.blocks[: self.layout.logical_pages_for(req.num_tokens)]

    def _copy_of(self, source: int, copy: int) -> int:
        """Copy block ``source``'s bytes onto ``copy`` (just taken); returns ``copy``."""
        self.backend.copy_pages(self.layout.physical_pages(np.array([source])).tolist(),
                                self.layout.physical_pages(np.array([copy])).tolist())
        self.stats.pages_copied += 1
        return copy

    def _block_window(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` uint8 rows."""
        pages = self.pool.num_pages * self.layout.pages_per_block  # filler pages may follow
        return self.backend.pool_window()[:pages].view(self.pool.num_pages, self.layout.block_bytes)
