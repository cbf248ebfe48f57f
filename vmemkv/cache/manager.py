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

A model whose layers read earlier positions by different rules (Gemma-2/3, GPT-OSS, Cohere2:
sliding-window and full-attention layers; Llama-4: chunked local and full) gets one manager over
one layer group per kind (``KVCacheManager.for_layers``): the same operations, each planned and
checked in every group before any group changes (``manager_state.py``).

This module has the manager's construction and the core operations (admission, growth, commit,
free, with their batched forms for an engine's step); what it tells without changing anything is
in ``queries.py``, the other operations in their own modules (see ``KVCacheManager``).
"""

from __future__ import annotations

from typing import Sequence

from vmemkv import validation as check
from vmemkv.cache.config import CacheConfig, CacheStats, PreemptionEstimate
from vmemkv.errors import ConfigError, InvalidInputError, ManagerClosedError, MappingLimitError, RequestStateError
from vmemkv.cache.hashing import CacheKeys
from vmemkv.cache.lookahead import LookaheadOps
from vmemkv.cache.metrics import KVMetricsCollector, timed
from vmemkv.cache.events import KVEventSink
from vmemkv.cache.layer_groups import LayerGroups, group_configs
from vmemkv.cache.manager_state import PrefixCacheBusyError, UnknownRequestError, WrongRequestStateError
from vmemkv.cache.refusal import Refusal
from vmemkv.cache.plans import check_plans_budget
from vmemkv.cache.preemption import PreemptionOps
from vmemkv.cache.queries import GroupReads, ManagerQueries
from vmemkv.cache.request import KVRequest
from vmemkv.cache.sharing import SharingOps

_NO_TOKENS = ()  # allocate's default: nothing to check or append

__all__ = ["CacheConfig", "CacheStats", "KVCacheManager", "KVRequest", "PreemptionEstimate",
           "PrefixCacheBusyError", "Refusal", "UnknownRequestError", "WrongRequestStateError", "GroupReads"]


class KVCacheManager(ManagerQueries, SharingOps, PreemptionOps, LookaheadOps):
    """The scheduler-facing API. This module holds the core (admission and growth, commit and
    prefix registration, freeing, close); the queries, sizes, views and stats are in
    ``queries.py``, fork, reorder and truncate in ``sharing.py``, preemption and swap in
    ``preemption.py``, the overlapped (lookahead) mapping in ``lookahead.py``, the layer groups,
    the requests, their helpers and the invariant check in ``manager_state.py``, each group's own
    steps in ``group.py``.

    ``KVCacheManager(config, backend=None, metrics=None, events=None, *, layer_windows=None,
    chunk_tokens=None, local_blocks=None, backends=None)``: ``backend`` defaults to the device's
    (``vmemkv.memory.vmm.create_backend``); ``metrics``, a ``vmemkv.KVMetricsCollector``, times the
    operations and the backend's mapping (``kv_metrics.py``; None costs about 0.15 µs per call);
    ``events``, a callable (e.g. ``vmemkv.KVEventBuffer``), is told every block stored in or
    removed from the prefix cache and every reset (``kv_events.py``; with several layer groups
    each event names its group, ``group_idx``).

    ``layer_windows`` gives each model layer's window (an int: a sliding window), its
    ``AttentionSpec`` (a chunked local layer) or None (full attention): one layer group per kind,
    each with its own virtual tensors and pool, the full-attention group first
    (``layout_groups``). ``config`` then describes the whole model: ``num_blocks`` blocks of all
    layers, whose bytes the groups share (``layer_groups.split_blocks``: each local group gets
    what its window needs at most, ``local_blocks`` when given, ``chunk_tokens`` being the most
    tokens one step computes); groups whose blocks have the same bytes share one pool
    (``memories``), whose blocks go to whichever group needs them, unless ``local_blocks`` fixes
    the local groups' shares; ``backends`` gives each pool's backend, a list or a callable taking
    the pool's config (tensor parallelism records them). Block counts (``num_blocks``, ``num_free_blocks``, ``blocks_for_tokens``, ...) are the
    first group's, the one that grows with a request; every operation checks every group."""

    @classmethod
    def for_layers(cls, config: CacheConfig, layer_windows, chunk_tokens: int | None = None,
                   metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None,
                   backends=None) -> "KVCacheManager":
        """A manager with one layer group per kind of ``layer_windows`` (each layer's window,
        ``AttentionSpec`` or None), or with one group of every layer (keeping every block) when
        ``layer_windows`` is None or the groups' pages cannot hold one number of tokens.
        ``backends``: makes a pool's backend from the pool's config (or None: each its own)."""
        if layer_windows:
            try:
                configs = group_configs(config, LayerGroups.from_windows(layer_windows), chunk_tokens)
            except ConfigError:
                configs = None
            if configs is not None and len(configs) > 1:
                return cls(config, metrics=metrics, events=events, layer_windows=layer_windows,
                           chunk_tokens=chunk_tokens, backends=backends)
        return cls(config, backend=None if backends is None else backends(config), metrics=metrics,
                   events=events)

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
        changing nothing, when no slot (or not ``slot``) or not enough blocks are free in every
        layer group (MappingLimitError, changing nothing, when the mapping budget does not take
        it). ``max_cached_tokens`` caps the prefix hit."""
        self._check_open()
        req = self._admission_request(request, token_ids, keys)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens", optional=True)
        token_budget = check.count(token_budget, "token_budget", optional=True)
        slot = check.slot_index(slot, self.num_slots)
        max_cached_tokens = check.count(max_cached_tokens, "max_cached_tokens", optional=True)
        admissions = self._admission(req, num_new_tokens, token_budget, max_cached_tokens)
        groups = self.groups
        needs = [group.admit_needs(admission.hits, admission.num_tokens)
                 for group, admission in zip(groups, admissions)]
        hits = [admission.hits for admission in admissions]
        if not self._slot_available(slot) or not self._fits(needs, hits):
            return self._refused("admit", req, slot, needs, hits)
        fresh = self._peek(needs, hits)
        plans = []
        for group, admission in zip(groups, admissions):  # the first group chooses the slot
            plans.append(group.plan_admit(admission.hits, slot, fresh[group.index]))
            slot = plans[0].slot
        if len(groups) > 1:
            check_plans_budget(groups, plans, "admit")
        # map (the one refusable step), share, then take every memory's blocks in one call: the
        # host tier's entries claimed first, so the take's own demotions cannot evict them
        for group, plan in zip(groups, plans):
            group.map_and_bind(plan)
        for group, plan in zip(groups, plans):
            group.pool.acquire(plan.share)
        claimed = self._claim([admission.promote for admission in admissions])
        self._take([plan.take for plan in plans])
        for group, alloc, admission, plan in zip(groups, req.allocations, admissions, plans):
            group.finish_admit(alloc, admission, plan, claimed[group.index])
        self._count_admission(req, admissions[0])
        return admissions[0].cached

    def _claim(self, promote: list[list[bytes]]) -> list[list]:
        """Each group's host-tier entries of ``promote[g]``, claimed from its memory's tier in one
        call (nothing evicts them until they are promoted)."""
        claimed: list[list] = [[]] * len(self.groups)  # replaced, never appended to
        if not any(promote):
            return claimed
        for memory in self.memories:
            keys = [key for group in memory.groups for key in promote[group.index]]
            if not keys:
                continue
            entries = memory.host_tier.claim(keys)
            for group in memory.groups:
                count = len(promote[group.index])
                claimed[group.index], entries = entries[:count], entries[count:]
        return claimed

    def _admission(self, req: KVRequest, num_new_tokens: int | None, token_budget: int | None,
                   max_cached_tokens: int | None) -> list:
        """What ``admit`` of ``req`` reuses and reserves in each group (arguments checked by the
        caller): the longest prefix every group reuses, from the device and then the host tiers;
        raises for a request already admitted or too long. Changes nothing but binding ``req``'s
        hash chain to this manager."""
        request_id, num_prompt, tokens_per_page = req.request_id, len(req.token_ids), self.tokens_per_page
        if request_id in self._requests:
            raise RequestStateError(f"request {request_id!r} is already admitted")
        self._check_length(request_id, num_prompt)
        self._own(req)
        hits = self._prefix_hits(req)
        limit = None if max_cached_tokens is None else max_cached_tokens // tokens_per_page
        if limit is not None and len(hits[0]) > limit:
            hits = self._common_hits(req.chain.hashes, hits, limit)
        reach = self._host_reach(req, hits, num_new_tokens, token_budget, limit)
        host_hits = req.chain.hashes[len(hits[0]):reach]
        cached = reach * tokens_per_page
        new = num_prompt - cached if num_new_tokens is None else num_new_tokens
        if token_budget is not None:
            new = min(new, token_budget)
        self._check_length(request_id, cached + new)
        return [group.admission(group_hits, host_hits, cached, cached + new)
                for group, group_hits in zip(self.groups, hits)]

    def _count_admission(self, req: KVRequest, admission) -> None:
        """Register an admitted request and count its prefix hit."""
        request_id, num_prompt, cached = req.request_id, len(req.token_ids), admission.cached
        self._requests[request_id] = req
        repeat = request_id in self._preempted
        self._preempted.discard(request_id)
        if not self.config.enable_prefix_caching:
            return
        if repeat:
            self.stats.reprefill_queried_tokens += num_prompt
            self.stats.reprefill_hit_tokens += cached
            return
        tokens_per_page = self.tokens_per_page
        host = admission.host_blocks * tokens_per_page
        self.stats.prefix_queried_tokens += num_prompt
        self.stats.prefix_hit_tokens += cached
        self.stats.prefix_hit_tokens_device += cached - host
        self.stats.prefix_hit_tokens_host += host
        tokens = req.token_ids
        hit_blocks = cached // tokens_per_page
        self.stats.prefix_partial_page_tokens += self.groups[0].pool.shared_partial_tokens(
            req.chain.hashes[hit_blocks - 1] if hit_blocks else self._chain_root(req.keys),
            tokens[cached:min(cached + tokens_per_page, len(tokens) - 1)])

    @timed
    def allocate(self, request: "KVRequest | str", num_new_tokens: int,
                 new_token_ids: Sequence[int] = _NO_TOKENS) -> bool:
        """Reserve ``num_new_tokens`` more positions (mapping a block only when crossing a block
        boundary), appending ``new_token_ids`` to the request's token ids (a KVRequest's owner may
        append them itself instead). Returns False, changing nothing, when the blocks are not
        there in every layer group."""
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
        ``new_token_ids``) in every group, or refuse (False, or the mapping budget's
        MappingLimitError) changing nothing."""
        groups, allocs = self.groups, req.allocations
        first = req.allocation
        total = first.num_tokens + num_new_tokens
        tokens_per_page = self.tokens_per_page
        needed = -(-total // tokens_per_page) - len(first.blocks)  # as many in every group
        if needed > 0 and not self._fits([needed] * len(groups)):
            self._short_of_blocks("allocate", req, first.slot, [needed] * len(groups))
            return False
        if -(-total // tokens_per_page) <= -(-first.num_tokens // tokens_per_page):
            for alloc in allocs:  # a decode inside its block (the engine's): nothing to map or take
                alloc.grow(num_new_tokens)
        else:
            fresh = self._peek([needed] * len(groups)) if needed > 0 else [[]] * len(groups)
            plans = [group.plan_grow(alloc, num_new_tokens, fresh[group.index])
                     for group, alloc in zip(groups, allocs)]
            if len(groups) > 1:
                check_plans_budget(groups, plans, "allocate")
            for group, plan in zip(groups, plans):
                group.map_grow(plan)  # the one refusable step
            self._take(fresh)
            for alloc, new_blocks in zip(allocs, fresh):
                alloc.grow(num_new_tokens, new_blocks)
        if new_token_ids:
            tokens = req.token_ids
            if req.chain.num_checked == len(tokens):  # every earlier token checked: these are too
                req.chain.mark_checked(len(tokens) + len(new_token_ids))
            tokens += new_token_ids
        return True

    @timed
    def allocate_each(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> int:
        """``allocate(requests[i], counts[i])`` for each i in order, as one operation (a
        scheduler's step: one call, not one per sequence through the timing wrapper), until one
        is refused: returns how many got their positions. The refused one (no blocks, or the
        mapping budget) and those after it are unchanged; bad input raises before any change."""
        if len(requests) != len(counts):
            raise InvalidInputError(f"{len(requests)} requests but {len(counts)} counts")
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
        that are now full join the prefix cache and are never written again; a windowed group
        gives back its blocks behind the window."""
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
        for req in reqs:  # _check_commit, called only where it has something to check
            allocation = req.allocation
            done = allocation.num_tokens
            if (not allocation.num_computed <= done <= len(req.token_ids)
                    or (caching and done // tokens_per_page * tokens_per_page > req.chain.num_checked)):
                self._check_commit(req, done)
        releases = self._releases
        for req in reqs:
            allocation = req.allocation
            done = allocation.num_tokens
            if releases or (caching and done // tokens_per_page > allocation.num_registered):
                self._commit(req, done)
            else:  # the common decode commit: no block filled, nothing behind a window
                for alloc in req.allocations:
                    alloc.commit(done)

    def _check_commit(self, req: KVRequest, done: int) -> None:
        """Refuse (raise) marking ``done`` tokens of ``req`` computed before anything changes."""
        allocation = req.allocation
        computed, reserved, known = allocation.num_computed, allocation.num_tokens, len(req.token_ids)
        if not computed <= done <= min(reserved, known):
            raise RequestStateError(
                f"request {req.request_id!r}: cannot mark {done} tokens computed; it has "
                f"{computed} computed, {reserved} reserved, {known} known")
        end = done // self.tokens_per_page * self.tokens_per_page
        if self.config.enable_prefix_caching and end > req.chain.num_checked:
            self._check_tokens(req, end)

    def _commit(self, req: KVRequest, done: int) -> None:
        full = done // self.tokens_per_page
        if self.config.enable_prefix_caching and full > req.allocation.num_registered:
            self._register_full(req, full)  # its tokens were checked by _check_commit
        for alloc in req.allocations:
            alloc.commit(done)
        if self._releases:
            for group, alloc in zip(self.groups, req.allocations):
                if group.spec.releases:
                    group.release_behind_window(alloc)

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
        for group, alloc in zip(self.groups, req.allocations):
            group.free(alloc)

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
        """Forget all cached content (every group's, and the host tiers'). Refused while any
        request holds blocks (their hashes would go stale mid-flight). Returns how many cached
        blocks (of the first group) were dropped."""
        self._check_open()
        for memory in self.memories:
            if memory.pool.num_in_use:
                raise PrefixCacheBusyError(
                    f"cannot reset the prefix cache: {memory.pool.num_in_use} blocks "
                    f"{memory.groups[0].in_group()}are held by {len(self._requests)} request(s); "
                    "free or finish them first")
        dropped = [memory.pool.reset_cache() + memory.host_tier.clear() for memory in self.memories]
        return dropped[0]

    # --- giving memory back ----------------------------------------------------------------------
    def release_free_memory(self, keep_blocks: int = 0, cached: bool = False) -> int:
        """Give the memory behind free clean blocks back to the OS (CPU: punched out of the memfd),
        keeping ``keep_blocks`` of them in each pool backed, the ones the next allocations take
        (a floor, so a step after an idle spell takes no page faults). Blocks held by requests
        keep theirs; cached blocks too unless ``cached``, which forgets the least recently used
        ones' content first (all of them but what ``keep_blocks`` still keeps). With a shared KV
        budget (``CacheConfig.kv_pool``) the bytes go back to the budget. Returns the bytes given
        back; 0 on a backend that cannot (CUDA, for now)."""
        self._check_open()
        keep_blocks = check.count(keep_blocks, "keep_blocks")
        if type(cached) is not bool:
            raise InvalidInputError(f"cached must be True or False, got {cached!r}")
        return sum(memory.give_back(keep_blocks, cached) * memory.layout.block_bytes
                   for memory in self.memories)

    def close(self) -> None:
        """Give the memory back; every later call raises ManagerClosedError. Refused while
        tensors viewing the memory (from kv_views/block_views) are still held: reading one
        after close would crash the process. Closing twice does nothing."""
        if self._closed:
            return
        held = sum(group.slots.views_in_use() for group in self.groups)
        if held:
            raise ManagerClosedError(
                f"cannot close the KV cache manager: {held} reference(s) to its K/V views (from "
                "kv_views/block_views, or tensors and arrays made from them) are still held; "
                "drop them first, since reading them after close would crash the process")
        self._closed = True
        for group in self.groups:
            group.slots.close()
        for memory in self.memories:
            memory.backend.close()
        if self.budget is not None:
            self.budget.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and any(group.slots.views_in_use() for group in self.groups):
            return  # closing would raise and hide the error in flight; the views stay readable
        self.close()
