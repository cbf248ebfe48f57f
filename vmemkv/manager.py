"""The scheduler-facing KV cache manager.

Each running request is bound to a slot and owns one reference on each block (logical page) of
its KV. The manager is mechanism only: it answers "can this fit?" with no side effects, and does
what it is told (admit, allocate, commit, fork, reorder, free, preempt, swap in). Whom to preempt
and when is the scheduler's business.

Life of a request (a :class:`vmemkv.KVRequest` the caller makes and owns; every operation also
accepts its id, looked up in the manager's registry)::

    req = KVRequest("r1", prompt_ids)             # prompt_ids: the caller's list, appended to later
    cached = manager.admit(req)                   # binds a slot, maps prefix hits, reserves the rest
    ... forward pass writes K/V for positions [cached, len(prompt_ids)) in slot req.slot ...
    manager.commit(req)                           # computed; full blocks join the prefix cache
    req.token_ids.append(next_token)
    manager.allocate(req, 1)                      # decode: a new block only at a block boundary
    ...
    manager.free(req)

About 500 lines: the core operations (with their batched forms for an engine's step) and the
queries a scheduler asks belong together; the other groups of operations are in their own modules
(see ``KVCacheManager``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import validation as check
from .cache_config import CacheConfig, CacheStats, PreemptionEstimate
from .errors import ManagerClosedError, MappingLimitError, RequestStateError
from .hashing import CacheKeys
from .lookahead import LookaheadOps
from .kv_metrics import timed
from .manager_state import PrefixCacheBusyError, UnknownRequestError
from .plans import Admission, Plan
from .preemption import PreemptionOps
from .request import RELEASED, KVRequest
from .sharing import SharingOps

_NO_TOKENS = ()  # allocate's default: nothing to check or append

__all__ = ["CacheConfig", "CacheStats", "KVCacheManager", "KVRequest", "PreemptionEstimate",
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
    def match_prefix(self, token_ids: "Sequence[int] | KVRequest",
                     keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of ``token_ids`` (whole blocks, leaving at least one
        token to compute) and the hashes of all full blocks of ``token_ids``. With a sliding
        window, the longest prefix whose blocks its next query's window reads are cached, with
        ``RELEASED`` (-1) for the blocks before that window (they need not be cached). Given a
        KVRequest, its own tokens and keys, and its hash chain (extended, never recomputed)."""
        self._check_open()
        if not self.config.enable_prefix_caching:
            return [], []
        if isinstance(token_ids, KVRequest):
            req = token_ids
            self._check_not_foreign(req)
            req.chain.claim(self)  # its hash chain is this manager's from now on
            hashes = list(self._extend_chain(req, len(req.token_ids) // self.tokens_per_page))
            return self._cached_blocks(hashes, len(req.token_ids)), hashes
        token_ids = self._token_ids(token_ids, "token_ids")
        hashes = self.hasher.block_hashes(token_ids, self.tokens_per_page, check.cache_keys(keys))
        return self._cached_blocks(hashes, len(token_ids)), hashes

    @timed
    def can_admit(self, token_ids: "Sequence[int] | KVRequest", keys: CacheKeys = CacheKeys()) -> bool:
        """Whether ``admit`` of all of ``token_ids`` (or of a KVRequest) would succeed now."""
        self._check_open()
        if isinstance(token_ids, KVRequest):
            self._check_not_foreign(token_ids)
            token_ids.chain.claim(self)
            self._check_tokens(token_ids, len(token_ids.token_ids))
            hits, total = self._prefix_hits(token_ids), len(token_ids.token_ids)
        else:
            hits, _ = self.match_prefix(token_ids, keys)
            total = len(token_ids)
        return self.slots.num_free > 0 and self._fits_admission(hits, total)

    @timed
    def can_allocate(self, request: "KVRequest | str", num_new_tokens: int) -> bool:
        req = self._running(request)
        return self._blocks_needed(req, check.count(num_new_tokens, "num_new_tokens")) <= self.pool.num_free

    @timed
    def blocks_needed(self, request: "KVRequest | str", num_new_tokens: int) -> int:
        req = self._running(request)
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
    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks held by requests."""
        return self.pool.num_in_use * self.layout.block_bytes

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

    @property
    def layout_groups(self) -> tuple["KVCacheManager", ...]:
        """The managers of this manager's layout groups, each with its own pool and virtual
        tensors: this one (a ``HybridKVCacheManager`` answers its global and local groups)."""
        return (self,)

    def free_slots(self) -> list[int]:
        self._check_open()
        return sorted(self.slots.free_slots())

    def is_slot_free(self, slot: int) -> bool:
        self._check_open()
        return self.slots.is_free(check.slot_index(slot, self.slots.num_slots))

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once. With a sliding
        window and ``chunk_tokens`` (the most tokens computed in one step: a prefill chunk),
        blocks behind the window are released as it runs, so it holds about the window plus a
        chunk (``AttentionSpec.peak_blocks``); otherwise every block of its tokens."""
        return self.spec.peak_blocks(num_tokens, chunk_tokens, self.tokens_per_page)

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None:
        """None when a request of ``num_tokens`` tokens (computed in chunks of at most
        ``chunk_tokens``, as ``blocks_for_tokens``) fits once nothing else is held; otherwise
        which limit it exceeds and what to change."""
        if num_tokens > self.config.max_model_len:
            return (f"{num_tokens} tokens exceed max_model_len {self.config.max_model_len}; "
                    "shorten it or raise max_model_len")
        blocks = self.blocks_for_tokens(num_tokens, chunk_tokens)
        if blocks > self.pool.num_blocks:
            return (f"{num_tokens} tokens need {blocks} KV blocks of {self.tokens_per_page} tokens "
                    f"but the pool has {self.pool.num_blocks}; shorten it or give the KV cache more "
                    "memory (num_blocks)")
        return None

    def can_ever_fit(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        """Whether a request of ``num_tokens`` tokens fits once nothing else is held."""
        return self.why_never_fits(num_tokens, chunk_tokens) is None

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
    def admit(self, request: "KVRequest | str", token_ids: Sequence[int] | None = None,
              num_new_tokens: int | None = None, keys: CacheKeys | None = None,
              token_budget: int | None = None, slot: int | None = None,
              max_cached_tokens: int | None = None) -> int | None:
        """Bind a request to a slot (``slot`` when given), map its cached prefix, and reserve
        positions for ``num_new_tokens`` more tokens (default: the rest of its token ids; at most
        ``token_budget``, for chunked prefill). ``request`` is a KVRequest (its token ids and keys
        are its own), or an id with ``token_ids`` (and ``keys``), for which the manager makes the
        KVRequest (``request(id)``). Returns how many tokens are already computed, or None,
        changing nothing, when no slot (or not ``slot``) or not enough blocks are free.
        ``max_cached_tokens`` caps the prefix hit (a hybrid model's groups agree on one length)."""
        self._check_open()
        req = self._admission_request(request, token_ids, keys)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens", optional=True)
        token_budget = check.count(token_budget, "token_budget", optional=True)
        slot = check.slot_index(slot, self.slots.num_slots)
        admission = self._admission(req, num_new_tokens, token_budget, check.count(
            max_cached_tokens, "max_cached_tokens", optional=True))
        if not self._slot_available(slot) or not self._fits_admission(admission.hits, admission.num_tokens):
            return None
        return self._execute_admit(req, admission, self._plan_admit(admission.hits, admission.num_tokens, slot))

    def _execute_admit(self, req: KVRequest, admission: Admission, plan: Plan) -> int:
        """Carry out ``plan`` (``_plan_admit`` of ``admission``: ``_admission``): map (the one
        step the mapping budget can refuse, changing nothing), then take the blocks, copying the
        host tier's hits in. Returns the tokens already computed."""
        self._map_and_bind(plan)
        self.pool.acquire(plan.share)
        cached, tokens_per_page = admission.cached, self.tokens_per_page
        req.allocation.bind(plan.slot, admission.hits + self._take_promoting(plan.take, admission.promote),
                            admission.num_tokens, cached, cached // tokens_per_page, plan.behind)
        request_id, num_prompt = req.request_id, len(req.token_ids)
        self._requests[request_id] = req
        repeat = request_id in self._preempted
        self._preempted.discard(request_id)
        if self.config.enable_prefix_caching:
            if repeat:
                self.stats.reprefill_queried_tokens += num_prompt
                self.stats.reprefill_hit_tokens += cached
            else:
                host = admission.host_blocks * tokens_per_page
                self.stats.prefix_queried_tokens += num_prompt
                self.stats.prefix_hit_tokens += cached
                self.stats.prefix_hit_tokens_device += cached - host
                self.stats.prefix_hit_tokens_host += host
                tokens = req.token_ids
                hit_blocks = cached // tokens_per_page
                self.stats.prefix_partial_page_tokens += self.pool.shared_partial_tokens(
                    req.chain.hashes[hit_blocks - 1] if hit_blocks else self._chain_root(req.keys),
                    tokens[cached:min(cached + tokens_per_page, len(tokens) - 1)])
        return cached

    @timed
    def allocate(self, request: "KVRequest | str", num_new_tokens: int,
                 new_token_ids: Sequence[int] = _NO_TOKENS) -> bool:
        """Reserve ``num_new_tokens`` more positions (mapping a block only when crossing a block
        boundary), appending ``new_token_ids`` to the request's token ids (a KVRequest's owner may
        append them itself instead). Returns False, changing nothing, when the blocks are not
        there."""
        req = self._running(request)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        if new_token_ids is not _NO_TOKENS:
            new_token_ids = self._token_ids(new_token_ids, "new_token_ids")
        total = req.allocation.num_tokens + num_new_tokens
        if total > self.config.max_model_len:
            self._check_length(req.request_id, total)
        return self._grow(req, num_new_tokens, new_token_ids)

    def _grow(self, req: KVRequest, num_new_tokens: int,
              new_token_ids: Sequence[int] = _NO_TOKENS) -> bool:
        """Reserve ``num_new_tokens`` more positions of a checked request (appending the checked
        ``new_token_ids``), or refuse (False, or the mapping budget's MappingLimitError) changing
        nothing."""
        allocation = req.allocation
        total = allocation.num_tokens + num_new_tokens
        if -(-total // self.tokens_per_page) - len(allocation.blocks) > self.pool.num_free:
            return False
        plan = self._plan_grow(req, num_new_tokens)
        if plan is None and not new_token_ids:
            allocation.grow(num_new_tokens)  # a decode inside its block (the engine's): one call less
        else:
            self._execute_grow(req, plan, num_new_tokens, new_token_ids)
        return True

    def _execute_grow(self, req: KVRequest, plan: Plan | None, num_new_tokens: int,
                      new_token_ids: Sequence[int] = _NO_TOKENS) -> None:
        """Carry out ``plan`` (``_plan_grow``; the mapping may be refused, changing nothing) and
        append the checked ``new_token_ids``."""
        new_blocks = []
        if plan is not None:  # crosses into blocks not mapped yet
            self.slots.map_blocks(plan.slot, plan.first, plan.mapped, plan.keep)  # may be refused
            if plan.take:
                new_blocks = self.pool.take(plan.take)
        req.allocation.grow(num_new_tokens, new_blocks)
        if new_token_ids:
            tokens = req.token_ids
            if req.chain.num_checked == len(tokens):  # every earlier token checked: these are too
                req.chain.mark_checked(len(tokens) + len(new_token_ids))
            tokens += new_token_ids

    @timed
    def allocate_each(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> int:
        """``allocate(requests[i], counts[i])`` for each i in order, as one operation (a
        scheduler's step: one call, not one per sequence through the timing wrapper), until one
        is refused: returns how many got their positions. The refused one (no blocks, or the
        mapping budget) and those after it are unchanged; bad input raises before any change."""
        if len(requests) != len(counts):
            raise ValueError(f"{len(requests)} requests but {len(counts)} counts")
        reqs = [self._running(request) for request in requests]
        counts = [check.count(count, "num_new_tokens") for count in counts]
        for req, count in zip(reqs, counts):
            if req.allocation.num_tokens + count > self.config.max_model_len:
                self._check_length(req.request_id, req.allocation.num_tokens + count)
        grow = self._grow
        for done, (req, count) in enumerate(zip(reqs, counts)):
            try:
                if not grow(req, count):
                    return done
            except MappingLimitError:
                return done
        return len(reqs)

    @timed
    def commit(self, request: "KVRequest | str", num_computed_tokens: int | None = None) -> None:
        """Mark positions up to ``num_computed_tokens`` (default: all reserved) as written. Blocks
        that are now full join the prefix cache and are never written again."""
        req = self._running(request)
        done = req.allocation.num_tokens if num_computed_tokens is None else check.count(
            num_computed_tokens, "num_computed_tokens")
        self._check_commit(req, done)
        self._commit(req, done)

    @timed
    def commit_all(self, requests: "Sequence[KVRequest | str]") -> None:
        """``commit(request)`` for each request (every reserved position written), as one
        operation (an engine's step: one call, not one per sequence through the timing
        wrapper). Every request is checked before any is committed."""
        reqs = [self._running(request) for request in requests]
        tokens_per_page, caching = self.tokens_per_page, self.config.enable_prefix_caching
        releases = self.spec.releases
        for req in reqs:  # _check_commit, called only where it has something to check
            allocation = req.allocation
            done = allocation.num_tokens
            if (not allocation.num_computed <= done <= len(req.token_ids)
                    or (caching and done // tokens_per_page * tokens_per_page > req.chain.num_checked)):
                self._check_commit(req, done)
        for req in reqs:
            allocation = req.allocation
            done = allocation.num_tokens
            if releases or (caching and done // tokens_per_page > allocation.num_registered):
                self._commit(req, done)
            else:  # the common decode commit: no block filled, nothing behind a window
                allocation.commit(done)

    def _check_commit(self, req: KVRequest, done: int) -> None:
        """Refuse (raise) marking ``done`` tokens of ``req`` computed before anything changes."""
        computed, reserved, known = req.allocation.num_computed, req.allocation.num_tokens, len(req.token_ids)
        if not computed <= done <= min(reserved, known):
            raise RequestStateError(
                f"request {req.request_id!r}: cannot mark {done} tokens computed; it has "
                f"{computed} computed, {reserved} reserved, {known} known")
        end = done // self.tokens_per_page * self.tokens_per_page
        if self.config.enable_prefix_caching and end > req.chain.num_checked:
            self._check_tokens(req, end)

    def _commit(self, req: KVRequest, done: int) -> None:
        full, allocation = done // self.tokens_per_page, req.allocation
        if self.config.enable_prefix_caching and full > allocation.num_registered:
            self._extend_chain(req, full)  # its tokens were checked by _check_commit
            blocks, hash_of = allocation.blocks, self.pool.hash_of
            for index in range(allocation.num_registered, full):
                if hash_of[blocks[index]] is None:
                    self._register(req, index)
            allocation.register(full)
        allocation.commit(done)
        if self.spec.releases:
            self._release_behind_window(req)

    # --- freeing ------------------------------------------------------------------------------------
    @timed
    def free(self, request: "KVRequest | str") -> None:
        """Release a request (running or swapped). Its blocks go back deepest first, so a shared
        prefix outlives its tails in the LRU queue; its slot keeps its mappings. A KVRequest keeps
        its token ids and hash chain and may be admitted again."""
        self._check_open()
        if request.__class__ is KVRequest:
            req = request if self._requests.get(request.request_id) is request else None
        else:
            req = self._requests.get(request) if type(request) is str else None
        if req is None:
            self._known(request)  # raises what is wrong with it
        request_id = req.request_id
        del self._requests[request_id]
        self._preempted.discard(request_id)
        if req.allocation.swapped is not None:
            swapped = {index for index, _ in req.allocation.swapped}
            self.swap.discard([host for _, host in req.allocation.swapped])
            self.pool.release(reversed([b for i, b in enumerate(req.allocation.blocks)
                                        if i not in swapped and b != RELEASED]))
        else:
            self.pool.release(reversed(req.allocation.blocks[req.allocation.num_released:]))
            self.slots.release(req.allocation.slot)
        req.allocation.reset()

    @timed
    def discard(self, request: "KVRequest | str") -> None:
        """Forget a request for good, in whatever state it is (an abort): free what it holds;
        a request preempted by recompute holds nothing and is just forgotten; an unknown id is
        ignored."""
        self._check_open()
        if isinstance(request, KVRequest):
            self._check_not_foreign(request)
            request_id = request.request_id
            held = self._requests.get(request_id) is request
        else:
            request_id = check.request_id(request)
            held = request_id in self._requests
        self._preempted.discard(request_id)
        if held:
            self.free(request)

    @timed
    def reset_prefix_cache(self) -> int:
        """Forget all cached content. Refused while any request holds blocks (their hashes would
        go stale mid-flight). Returns how many cached blocks were dropped."""
        self._check_open()
        if self.pool.num_in_use:
            raise PrefixCacheBusyError(
                f"cannot reset the prefix cache: {self.pool.num_in_use} blocks are held by "
                f"{len(self._requests)} request(s); free or finish them first")
        return self.pool.reset_cache() + self.host_tier.clear()

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

    def request(self, request_id: str) -> KVRequest:
        """The admitted (running or swapped) request of this id: the caller's KVRequest, or the
        one ``admit`` made for an id."""
        return self._known(check.request_id(request_id))

    @timed
    def slot_of(self, request: "KVRequest | str") -> int:
        return self._running(request).allocation.slot

    @timed
    def num_tokens(self, request: "KVRequest | str") -> int:
        return self._running(request).allocation.num_tokens

    def num_computed_tokens(self, request: "KVRequest | str") -> int:
        return self._known(request).allocation.num_computed

    @timed
    def block_table(self, request: "KVRequest | str") -> list[int]:
        return list(self._running(request).allocation.blocks)

    def token_ids(self, request: "KVRequest | str") -> list[int]:
        """A copy of the request's token ids (a KVRequest's own list is ``request.token_ids``)."""
        return list(self._known(request)._token_ids)

    def is_swapped(self, request: "KVRequest | str") -> bool:
        self._check_open()
        if isinstance(request, KVRequest):
            return self._requests.get(request.request_id) is request and request.is_swapped
        req = self._requests.get(check.request_id(request))
        return req is not None and req.allocation.swapped is not None

    def request_ids(self) -> list[str]:
        self._check_open()
        return list(self._requests)

    def snapshot_stats(self) -> dict:
        self._check_open()
        pool = self.pool.counters()
        slots = self.slots.stats
        return {
            **{k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__},
            "pages_copied": self.stats.blocks_copied,  # the old name of blocks_copied, for one release
            "prefix_hit_rate": self.stats.prefix_hit_rate,
            "usage": self.usage(),
            "blocks_total": pool.num_blocks, "blocks_in_use": pool.in_use,
            "blocks_cached": pool.cached, "blocks_clean": pool.clean, "evictions": pool.evictions,
            "host_blocks_cached": len(self.host_tier), "host_blocks_total": self.host_tier.capacity,
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
