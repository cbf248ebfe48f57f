"""What every part of the KV cache manager shares: its parts, its requests, and the small steps
the operations are built from.

The requests are the callers' :class:`vmemkv.KVRequest` objects (``request.py``), whose hash
chain and allocation (``allocation.py``) only the manager changes, through their transitions;
``_requests`` registers the admitted ones by id, for callers that name a request by its id and
for the invariant check. ``_running`` and ``_known``
turn either form into the object: an object of this manager's that is running costs no lookup.

``KVCacheManager`` (``manager.py``) is this state plus three groups of operations, each in its own
module: the core (admit, allocate, commit, free, lookahead, queries) in ``manager.py``, sharing
(fork, reorder, truncate) in ``sharing.py``, preemption (estimate, preempt, swap in) in
``preemption.py``. Every mutating operation plans first (``pool.peek``, ``slots.choose``; the plans
of admit, allocate, fork and swap in are methods of their own in ``plans.py``, which the hybrid
budget asks too), asks the one refusable step (``slots.map_jobs``), and only then changes anything
(``pool.take``/``acquire``, ``slots.bind``, the request), so a refusal leaves nothing half done.

The host block store ``swap`` holds both swapped-out blocks and the prefix cache's host tier
(``host_tier``: blocks the pool evicts are demoted there, and an admission promotes its hits back,
``_host_hits`` and ``_take_promoting``).

The parts (``pool``, ``slots``, ``backend``, ``swap``, ``host_tier``, ``hasher``, ``stats``) are
attributes for the manager's own modules, its tests and benchmarks; code that *uses* a manager
(the engine, the integrations) asks its public queries instead (``num_free_blocks``,
``blocks_for_tokens``, ``can_ever_fit``, ``cache_stats``, ...). ``layout`` is public and
read-only: a frozen description of where K and V sit, which attention needs anyway.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import validation as check
from .cache_config import CacheConfig, CacheStats
from .errors import (ConfigError, InvalidInputError, ManagerClosedError, MappingLimitError,
                     RequestStateError, RequestTooLongError, VmemkvError)
from .hashing import CacheKeys, PrefixHasher
from .host_tier import HostTier
from .kv_events import KVEventSink, check_sink
from .kv_metrics import KVMetricsCollector
from .layout import KVLayout
from .pool import BlockPool, EvictedBlock
from .request import RELEASED, KVRequest
from .slots import SlotMapper, SlotBinder
from .swap import SwapSpace
from .vmm import create_backend
from .vmm.base import VirtualMemoryBackend
from .attention_spec import AttentionSpec


class PrefixCacheBusyError(VmemkvError):
    """The prefix cache cannot be reset while requests hold blocks."""


class UnknownRequestError(VmemkvError, KeyError):
    """No request with this id is known to the manager (in that state)."""


def backend_pages(config: CacheConfig, layout: KVLayout) -> tuple[int, int | None]:
    """How many physical pages the manager's backend holds, and the hole page's index (or None).

    The pool's pages first. On CPU, slots read in one batched call need filler pages past the
    pool (``SlotMapper.make_readable``): one slot's worth, owned by no request, touched only where
    read. On CUDA with a sliding window, pages behind a window point at one "hole" page past
    those (FlashAttention may load a tile before the window start, and an unmapped address there
    faults); on CPU they are unmapped (no CPU path reads them)."""
    pages = config.num_blocks * layout.pages_per_block
    cuda = str(config.device).startswith("cuda")
    if config.kv_backend == "vmem" and not cuda:
        pages += layout.slot_pages(config.max_model_len)
    if config.kv_backend == "vmem" and cuda and (config.sliding_window or config.attention_chunk_size):
        return pages + 1, pages
    return pages, None


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
    host_tier: HostTier
    stats: CacheStats
    metrics: KVMetricsCollector | None  # timing of operations and mapping (kv_metrics.py)

    def __init__(self, config: CacheConfig, backend: VirtualMemoryBackend | None = None,
                 metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None):
        self.config = check.config(config)
        try:
            check.count(config.sliding_window, "CacheConfig.sliding_window", minimum=1, optional=True)
            check.count(config.attention_chunk_size, "CacheConfig.attention_chunk_size", minimum=1,
                        optional=True)
        except InvalidInputError as error:
            raise ConfigError(str(error)) from None
        # what the layers read, so what is released while a request runs (attention_spec.py)
        self.spec = AttentionSpec.of(config.sliding_window, config.attention_chunk_size)
        self.window = self.spec.window
        if metrics is not None and not isinstance(metrics, KVMetricsCollector):
            raise ConfigError(f"metrics must be a vmemkv.KVMetricsCollector or None; got "
                              f"{type(metrics).__name__}")
        self.metrics = metrics
        self._layout = config.make_layout()
        self.tokens_per_page = self._layout.tokens_per_page
        num_pages, hole = backend_pages(config, self._layout)
        self.backend = backend or create_backend(config.device, self._layout.page_size, num_pages)
        if metrics is not None:  # the backend reports its map/unmap time to the same collector
            self.backend.metrics = metrics
        self.events = check_sink(events)  # told what enters and leaves the prefix cache
        self.pool = BlockPool(config.num_blocks, self.events, self.tokens_per_page)
        # "vmem": virtually contiguous slots; "paged": the block-table baseline (same pool, same
        # blocks, addressed through each request's block list; nothing is mapped). check.config
        # allowed only these two.
        if config.kv_backend == "vmem":
            self.slots = SlotMapper(self.backend, self._layout, config.max_num_seqs,
                                    config.max_model_len, config.num_blocks, hole_page=hole)
        else:
            self.slots = SlotBinder(self.backend, self._layout, config.max_num_seqs,
                                    config.max_model_len, config.num_blocks)
        self.hasher = PrefixHasher(config.hash_algorithm, config.hash_seed)
        self._chain_root = functools.lru_cache(256)(self.hasher.root)  # keys -> root hash, 1 µs saved
        block_bytes = self._layout.block_bytes
        host_tier_blocks = config.host_cache_bytes // block_bytes if config.enable_prefix_caching else 0
        # one host block store: swap_space_bytes of rows for swapped requests beside the tier's
        self.swap = SwapSpace(config.swap_space_bytes // block_bytes + host_tier_blocks, block_bytes,
                              pin_memory=str(config.device).startswith("cuda"))
        self.stats = CacheStats()
        self.host_tier = HostTier(host_tier_blocks, self.swap, self.tokens_per_page, self.events,
                                  self.stats)
        if host_tier_blocks:
            self.pool.on_evict = self._demote
        self._requests: dict[str, KVRequest] = {}  # admitted (running or swapped), by id
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
            name, held_by = req.request_id, req.allocation
            blocks, released, num_tokens = held_by.blocks, held_by.num_released, held_by.num_tokens
            assert req.chain.owner is self, f"{name} belongs to another manager"
            swapped = {i for i, _ in held_by.swapped} if held_by.swapped is not None else set()
            assert all(b == RELEASED for b in blocks[:released]), f"{name}: released run"
            assert RELEASED not in blocks[released:], f"{name}: a hole past the released run"
            assert released <= self.spec.first_needed_block(held_by.num_computed, self.tokens_per_page), (
                f"{name}: released {released} blocks, its next query reads one of them")
            held = [b for i, b in enumerate(blocks) if i not in swapped and i >= released]
            np.add.at(refs, np.asarray(held, dtype=np.int64), 1)
            assert held_by.num_computed <= num_tokens <= len(blocks) * self.tokens_per_page
            # Blocks past the reservation are lookahead: mapped early, private, unhashed (below).
            assert len(blocks) >= self._layout.logical_pages_for(num_tokens), (
                f"{name}: {len(blocks)} blocks for {num_tokens} tokens")
            assert held_by.num_registered <= len(req.chain.hashes)
            if held_by.swapped is not None:
                assert len(blocks) == self._layout.logical_pages_for(num_tokens)
                assert held_by.slot is None
                continue
            bound.append(held_by.slot)
            self.slots.check_request(held_by.slot, blocks, released)
            for block in blocks[held_by.num_computed // self.tokens_per_page:]:  # writable pages
                assert self.pool.hash_of[block] is None, f"{name} can write hashed block {block}"
                assert self.pool.ref[block] == 1, f"{name} can write shared block {block}"
                assert block not in writers, f"block {block} writable by {writers.get(block)} and {name}"
                writers[block] = name
        assert np.array_equal(refs, np.asarray(self.pool.ref)), "reference counts differ from references held"
        assert len(set(bound)) == len(bound), "two requests share a slot"
        assert not set(bound) & set(self.slots.free_slots()), "a bound slot is also free"
        assert len(bound) + self.slots.num_free == self.slots.num_slots, "a slot was lost"
        swapped_host = [host for r in self._requests.values() if r.allocation.swapped is not None
                        for _, host in r.allocation.swapped]
        self.host_tier.check()
        tier_rows = self.host_tier.rows()
        assert not set(swapped_host) & set(tier_rows), "a host row is both swapped and cached"
        assert len(swapped_host) + len(tier_rows) + self.swap.num_free == self.swap.num_blocks, (
            "host rows leaked")

    # --- looking requests up and checking arguments ----------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("this KV cache manager is closed; its memory is gone. "
                                     "Create a new one")

    def _running(self, request) -> KVRequest:
        """The running request ``request`` names: a KVRequest (no lookup) or its id."""
        if request.__class__ is KVRequest:
            if request.chain.owner is self and request.allocation.slot is not None and not self._closed:
                return request  # the hot path
        elif type(request) is str:
            req = self._requests.get(request)
            if req is not None and req.allocation.slot is not None and not self._closed:
                return req
        req = self._known(request)
        if req.allocation.swapped is not None:
            raise UnknownRequestError(f"request {req.request_id!r} is swapped out, not running; "
                                      "swap_in() it first")
        return req

    def _running_list(self, requests, what: str) -> list[KVRequest]:
        """A list or tuple of running requests (not a bare string, read letter by letter)."""
        if not isinstance(requests, (list, tuple)):
            example = f", such as [{requests!r}]" if isinstance(requests, (str, KVRequest)) else ""
            raise InvalidInputError(f"{what} is a {type(requests).__name__}; pass a list of "
                                    f"KVRequests or request ids{example}")
        return [self._running(request) for request in requests]

    def _known(self, request) -> KVRequest:
        """An admitted (running or swapped) request: a KVRequest of this manager's or an id;
        UnknownRequestError for one that is not admitted, InvalidInputError for anything else."""
        self._check_open()
        if isinstance(request, KVRequest):
            self._check_not_foreign(request)
            if self._requests.get(request.request_id) is not request:
                raise UnknownRequestError(f"request {request.request_id!r} is not admitted (new, "
                                          "freed, or preempted by recompute); admit() it first")
            return request
        if type(request) is not str:
            raise InvalidInputError(f"request is a {type(request).__name__} ({request!r:.40}); pass a "
                                    "vmemkv.KVRequest or its request id (a str)")
        req = self._requests.get(request)
        if req is None:
            raise UnknownRequestError(f"no request {request!r}; admit() it first")
        return req

    def _check_not_foreign(self, request: KVRequest) -> None:
        if request.chain.owner is not None and request.chain.owner is not self:
            raise InvalidInputError(
                f"request {request.request_id!r} belongs to another KVCacheManager (its block "
                "hashes were made with that manager's hasher); make a new KVRequest for this one")

    def _check_tokens(self, req: KVRequest, end: int) -> None:
        """Check the request's token ids up to ``end`` that were not checked yet (the caller
        appends to the list; each id is checked once, when the manager first reads it)."""
        if end > req.chain.num_checked:
            check.token_ids(req.token_ids[req.chain.num_checked:end],
                            f"request {req.request_id!r}'s token_ids", self.config.vocab_size)
            req.chain.mark_checked(end)

    def _extend_chain(self, req: KVRequest, num_blocks: int) -> list[bytes]:
        """The request's hash chain, extended to its first ``num_blocks`` full blocks (as far as
        its tokens go): only blocks never hashed are hashed."""
        chain = req.chain
        hashes = chain.hashes
        if num_blocks > len(hashes):
            tokens_per_page = self.tokens_per_page
            if num_blocks * tokens_per_page > chain.num_checked:
                self._check_tokens(req, min(num_blocks * tokens_per_page, len(req.token_ids)))
            chain.extend(self.hasher.block_hashes(req.token_ids, tokens_per_page, chain.keys,
                                                  start_block=len(hashes),
                                                  parent=hashes[-1] if hashes else None,
                                                  end_block=num_blocks))
        return chain.hashes

    def _token_ids(self, token_ids, what: str) -> list[int]:
        return check.token_ids(token_ids, what, self.config.vocab_size)

    def _check_length(self, request_id: str, num_tokens: int) -> None:
        if num_tokens > self.config.max_model_len:
            raise RequestTooLongError(
                f"request {request_id!r} needs {num_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}; shorten it or raise max_model_len")

    def _slot_available(self, slot: int | None) -> bool:
        return self.slots.num_free > 0 if slot is None else self.slots.is_free(slot)

    def _require_committed(self, req: KVRequest) -> None:
        if req.allocation.num_computed != req.allocation.num_tokens:
            raise RequestStateError(
                f"request {req.request_id!r} has {req.num_tokens - req.num_computed_tokens} reserved "
                "tokens not yet computed; commit() them first")

    # --- steps the operations share --------------------------------------------------------------
    def _blocks_needed(self, req: KVRequest, num_new_tokens: int) -> int:
        """New blocks for ``num_new_tokens`` more positions (lookahead blocks count as held)."""
        allocation = req.allocation
        end = allocation.num_tokens + num_new_tokens
        return max(-(-end // self.tokens_per_page) - len(allocation.blocks), 0)

    def _fits_admission(self, hits: list[int], total: int) -> bool:
        needed = self._layout.logical_pages_for(total) - len(hits)
        revived = sum(self.pool.ref[b] == 0 for b in hits if b != RELEASED)  # leave the free queue
        return needed <= self.pool.num_free - revived

    def _register(self, req: KVRequest, index: int) -> None:
        """Offer full block ``index`` of ``req`` to the prefix cache, with its tokens and parent
        (for KV events and the partial-page hit count)."""
        tokens = req.token_ids[index * self.tokens_per_page:(index + 1) * self.tokens_per_page]
        parent = req.chain.hashes[index - 1] if index else None
        self.pool.register(req.allocation.blocks[index], req.chain.hashes[index], tokens, parent,
                           None if index else self._chain_root(req.keys))

    def _reserved_blocks(self, req: KVRequest) -> list[int]:
        """The request's blocks without lookahead ones."""
        return req.allocation.blocks[: self._layout.logical_pages_for(req.allocation.num_tokens)]

    def _trim_lookahead(self, req: KVRequest) -> None:
        """Release blocks past the reservation (given early by allocate_lookahead)."""
        needed = self._layout.logical_pages_for(req.allocation.num_tokens)
        if len(req.allocation.blocks) > needed:
            self.pool.release(reversed(req.allocation.drop_from(needed)))

    def _cached_blocks(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """The cached blocks of the leading ``hashes`` (at least one of ``num_tokens`` left); with
        a window or chunks, ``_windowed_hits``."""
        if self.spec.releases:
            return self._windowed_hits(hashes[: (num_tokens - 1) // self.tokens_per_page])
        hits = []
        for h in hashes[: (num_tokens - 1) // self.tokens_per_page]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _windowed_hits(self, hashes: list[bytes]) -> list[int]:
        """The longest prefix of ``hashes`` whose blocks the next query reads are all cached
        (earlier blocks need not be: ``AttentionSpec.prefix_hits``), as a block list with
        ``RELEASED`` before its first read: ``[RELEASED] * first + cached blocks``."""
        lookup = self.pool.lookup
        num_hits, first = self.spec.prefix_hits(len(hashes), lambda i: lookup(hashes[i]) is not None,
                                                self.tokens_per_page)
        return [RELEASED] * first + [lookup(h) for h in hashes[first:num_hits]]

    def _capped_hits(self, req: KVRequest, hits: list[int], max_blocks: int) -> list[int]:
        """``hits`` (``_prefix_hits``) cut to at most ``max_blocks`` blocks; with a window, the
        longest windowed hit within them (a shorter prefix's window starts earlier)."""
        if len(hits) <= max_blocks:
            return hits
        if self.spec.releases:
            return self._windowed_hits(req.chain.hashes[:max_blocks])
        return hits[:max_blocks]

    def _release_behind_window(self, req: KVRequest) -> None:
        """Give back the running request's blocks wholly behind its next query's window (cached
        ones stay in the prefix cache's LRU) and unmap them from its slot. Opportunistic: if the
        mapping budget refuses the unmap, nothing changes and a later commit tries again."""
        allocation = req.allocation
        released = allocation.num_released
        first = min(self.spec.first_needed_block(allocation.num_computed, self.tokens_per_page),
                    len(allocation.blocks))
        if first <= released:
            return
        try:
            self.slots.release_behind(allocation.slot, first)
        except MappingLimitError:
            return
        # oldest first into the LRU queue: a windowed prefix hit needs the blocks near its end,
        # so the earliest ones are the first to be evicted
        self.pool.release(allocation.release_behind(first))
        self.stats.blocks_released_behind_window += first - released

    def _live(self, blocks: list[int]) -> list[int]:
        """``blocks`` without ``RELEASED`` entries."""
        return [b for b in blocks if b != RELEASED]

    def _prefix_hits(self, req: KVRequest) -> list[int]:
        """``req``'s cached prefix blocks, hashing only blocks its chain does not cover yet."""
        if not self.config.enable_prefix_caching:
            return []
        num_tokens = len(req.token_ids)
        return self._cached_blocks(self._extend_chain(req, (num_tokens - 1) // self.tokens_per_page),
                                   num_tokens)

    def _host_hits(self, req: KVRequest, hits: list[int], num_new_tokens: int | None,
                   token_budget: int | None) -> list[bytes]:
        """The hashes continuing ``req``'s device ``hits`` that the host tier holds (whole
        blocks, leaving at least one token to compute), as many as the free blocks take: each
        is copied into a fresh block, and under a token budget (chunked prefill) a shorter hit
        may need fewer blocks now. No side effect; ``admit`` sizes the admission the same way."""
        if not self.host_tier.capacity:
            return []
        tokens_per_page, num_prompt = self.tokens_per_page, len(req.token_ids)
        run = self.host_tier.leading_hits(req.chain.hashes[len(hits):(num_prompt - 1) // tokens_per_page])
        for keep in range(len(run), 0, -1):
            cached = (len(hits) + keep) * tokens_per_page
            new = num_prompt - cached if num_new_tokens is None else num_new_tokens
            if token_budget is not None:
                new = min(new, token_budget)
            if self._fits_admission(hits, cached + new):
                return run[:keep]
        return []

    def _take_promoting(self, planned: list[int], host_hits: list[bytes]) -> list[int]:
        """Take the ``planned`` blocks (``pool.peek``) and copy the host tier's ``host_hits``
        into the first of them, registered in the device pool again. Call it only once every
        refusable step of the operation succeeded: it changes the tier and the pool."""
        claimed = self.host_tier.claim(host_hits)  # the take's own demotions cannot evict them
        blocks = self.pool.take(planned)
        promoted = blocks[:len(host_hits)]
        origins = self.host_tier.promote(self.block_window(), host_hits, claimed, promoted)
        for block, block_hash, origin in zip(promoted, host_hits, origins):
            self.pool.register(block, block_hash, origin.token_ids, origin.parent_hash, origin.root)
        return blocks

    def _demote(self, evicted: list[EvictedBlock]) -> None:
        """The pool's eviction hook: evicted cached blocks go to the host tier."""
        self.host_tier.demote(self.block_window(), evicted)

    def _admission_request(self, request, token_ids, keys) -> KVRequest:
        """The KVRequest ``admit`` works on: the caller's (its tokens checked), or a new one."""
        if isinstance(request, KVRequest):
            if token_ids is not None or keys is not None:
                raise InvalidInputError(
                    f"admit({request.request_id!r}): a KVRequest carries its own token ids and keys; "
                    "give them when you make it, or admit by id with token_ids")
            self._check_not_foreign(request)
            self._check_tokens(request, len(request.token_ids))
            return request
        request_id = check.request_id(request)
        if token_ids is None:
            raise InvalidInputError(f"admit({request_id!r}) needs token_ids (or admit a KVRequest)")
        token_ids = self._token_ids(token_ids, "token_ids")
        req = KVRequest(request_id, list(token_ids), CacheKeys() if keys is None else keys)
        req.chain.mark_checked(len(token_ids))
        return req

    def _copy_of(self, source: int, copy: int) -> int:
        """Copy block ``source``'s bytes onto ``copy`` (just taken); returns ``copy``."""
        self.backend.copy_pages(self._layout.physical_pages(np.array([source])).tolist(),
                                self._layout.physical_pages(np.array([copy])).tolist())
        self.stats.blocks_copied += 1
        return copy

    def block_window(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` uint8 rows: what swap, the host tier and
        tensor-parallel replay copy blocks through."""
        pages = self.pool.num_blocks * self._layout.pages_per_block  # filler pages may follow
        return self.backend.pool_window()[:pages].view(self.pool.num_blocks, self._layout.block_bytes)
