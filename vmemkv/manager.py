"""The scheduler-facing KV cache manager.

Each running request is bound to a slot and owns one reference on each block (logical page) of
its KV. The manager is mechanism only: it answers "can this fit?" with no side effects, and does
what it is told (admit, allocate, commit, fork, reorder, free, preempt, swap in). Whom to preempt
and when is the scheduler's business.

Life of a request::

    cached = manager.admit("r1", prompt_ids)      # binds a slot, maps prefix hits, reserves the rest
    ... forward pass writes K/V for positions [cached, len(prompt_ids)) through kv_views() ...
    manager.commit("r1")                          # computed; full blocks join the prefix cache
    manager.allocate("r1", 1, [next_token])       # decode: a new block only at a block boundary
    ...
    manager.free("r1")
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import validation as check
from .cache_config import CacheConfig, CacheStats, PreemptionEstimate
from .errors import ManagerClosedError, PageStateError
from .hashing import CacheKeys
from .lookahead import LookaheadOps
from .kv_metrics import timed
from .manager_state import PrefixCacheBusyError, UnknownRequestError, _Request
from .preemption import PreemptionOps
from .sharing import SharingOps
from .slots import MapJob

__all__ = ["CacheConfig", "CacheStats", "KVCacheManager", "PreemptionEstimate",
           "PrefixCacheBusyError", "UnknownRequestError"]


class KVCacheManager(SharingOps, PreemptionOps, LookaheadOps):
    """The scheduler-facing API. This module holds the core (queries, admission and growth,
    commit and prefix registration, freeing, views, stats, close); fork, reorder and truncate
    are in ``sharing.py``, preemption and swap in ``preemption.py``, the overlapped (lookahead)
    mapping in ``lookahead.py``, the shared state, its helpers and the invariant check in
    ``manager_state.py``.

    ``KVCacheManager(config, backend=None, metrics=None)``: ``backend`` defaults to the device's
    (``vmemkv.vmm.create_backend``); ``metrics``, a ``vmemkv.KVMetricsCollector``, times the
    operations and the backend's mapping (``kv_metrics.py``; None costs about 0.15 µs per call);
    ``events``, a callable (e.g. ``vmemkv.KVEventBuffer``), is told every block stored in or
    removed from the prefix cache and every reset (``kv_events.py``)."""

    # --- queries without side effects ----------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        self._check_open()
        return self.slots.num_free

    @timed
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        self._check_open()
        return self.pool.num_in_use / self.pool.num_blocks

    @timed
    def match_prefix(self, token_ids: Sequence[int], keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of ``token_ids`` (whole blocks, leaving at least one
        token to compute) and the hashes of all full blocks of ``token_ids``."""
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

    @timed
    def can_admit(self, token_ids: Sequence[int], keys: CacheKeys = CacheKeys()) -> bool:
        """Whether ``admit`` of all of ``token_ids`` would succeed now."""
        self._check_open()
        hits, _ = self.match_prefix(token_ids, keys)
        return self.slots.num_free > 0 and self._fits_admission(hits, len(token_ids))

    @timed
    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        req = self._running(request_id)
        return self._blocks_needed(req, check.count(num_new_tokens, "num_new_tokens")) <= self.pool.num_free

    @timed
    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        req = self._running(request_id)
        return self._blocks_needed(req, check.count(num_new_tokens, "num_new_tokens"))

    # --- sizes and counts (what a scheduler or an adapter asks instead of reading the parts) -----
    @property
    def num_blocks(self) -> int:
        """Blocks (logical pages) in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: clean ones and cached ones (evicted when taken)."""
        return self.pool.num_free

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_in_use

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding prefix-cache content."""
        return self.pool.num_cached

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers' K and V of ``tokens_per_page`` tokens."""
        return self.layout.block_bytes

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    def free_slots(self) -> list[int]:
        self._check_open()
        return sorted(self.slots.free_slots())

    def is_slot_free(self, slot: int) -> bool:
        self._check_open()
        return self.slots.is_free(check.slot_index(slot, self.slots.num_slots))

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds."""
        return self.layout.logical_pages_for(num_tokens)

    def why_never_fits(self, num_tokens: int) -> str | None:
        """None when a request of ``num_tokens`` tokens fits once nothing else is held; otherwise
        which limit it exceeds and what to change."""
        if num_tokens > self.config.max_model_len:
            return (f"{num_tokens} tokens exceed max_model_len {self.config.max_model_len}; "
                    "shorten it or raise max_model_len")
        blocks = self.blocks_for_tokens(num_tokens)
        if blocks > self.pool.num_blocks:
            return (f"{num_tokens} tokens need {blocks} KV blocks of {self.tokens_per_page} tokens "
                    f"but the pool has {self.pool.num_blocks}; shorten it or give the KV cache more "
                    "memory (num_blocks)")
        return None

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits once nothing else is held."""
        return self.why_never_fits(num_tokens) is None

    def cache_stats(self) -> CacheStats:
        """A copy of the counters (prefix hits, preemptions, swap bytes, forks, block copies)."""
        self._check_open()
        return dataclasses.replace(self.stats)

    def batched_reads(self):
        """What CPU attention needs to read several consecutive slots in one call
        (``make_readable``, ``release_reads``, ``num_layers``: ``attention.contiguous.SlotReads``)."""
        self._check_open()
        return self.slots

    # --- admission and growth ------------------------------------------------------------------
    @timed
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
        # Plan (slot, blocks), map (the one step the mapping budget can refuse), then take.
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
                self.stats.prefix_hit_tokens_device += cached
                self.stats.prefix_partial_page_tokens += self.pool.shared_partial_tokens(
                    hashes[len(hits) - 1] if hits else self._chain_root(keys),
                    token_ids[cached:min(cached + self.tokens_per_page, len(token_ids) - 1)])
        return cached

    @timed
    def allocate(self, request_id: str, num_new_tokens: int, new_token_ids: Sequence[int] = ()) -> bool:
        """Reserve ``num_new_tokens`` more positions (mapping a block only when crossing a block
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

    @timed
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
                self._register(req, index)
        req.num_registered = full

    # --- freeing ------------------------------------------------------------------------------------
    @timed
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

    @timed
    def discard(self, request_id: str) -> None:
        """Forget a request for good, in whatever state it is (an abort): free what it holds;
        a request preempted by recompute holds nothing and is just forgotten; an unknown id is
        ignored."""
        self._check_open()
        request_id = check.request_id(request_id)
        self._preempted.discard(request_id)
        if request_id in self._requests:
            self.free(request_id)

    @timed
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

    @timed
    def slot_of(self, request_id: str) -> int:
        return self._running(request_id).slot

    @timed
    def num_tokens(self, request_id: str) -> int:
        return self._running(request_id).num_tokens

    def num_computed_tokens(self, request_id: str) -> int:
        return self._known(request_id).num_computed

    @timed
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
            "blocks_total": pool.num_blocks, "blocks_in_use": pool.in_use,
            "blocks_cached": pool.cached, "blocks_clean": pool.clean, "evictions": pool.evictions,
            "map_calls": slots.map_calls, "pages_mapped": slots.pages_mapped,
            "map_calls_saved": slots.pages_already_mapped, "unmap_calls": slots.unmap_calls,
            "pages_unmapped": slots.pages_unmapped,
            "tokens_per_page": self.tokens_per_page, "page_bytes": self.layout.page_size,
            "padding_fraction": self.layout.padding_fraction,
            "backend_map_seconds": self.backend.stats.map_seconds,
            "backend_unmap_seconds": self.backend.stats.unmap_seconds,
        }

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
