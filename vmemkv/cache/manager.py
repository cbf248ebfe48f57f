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
checked in every group before any group changes (``coordinator.py``).

The manager is a facade that composes, as vLLM v1's ``KVCacheManager``: it holds its parts and
calls their public methods, and no part reads another's private state::

    KVCacheManager
    ├── registry     RequestRegistry     admitted requests by id, lookups, argument checks, hash chains
    ├── coordinator  KVCacheCoordinator  the layer groups and the memories (pools, swap, host tier)
    ├── queries      CacheQueries        what it answers without changing anything
    ├── sharing      Sharing             fork, reorder, truncate
    ├── preemption   Preemption          estimate, swap out, swap in
    └── lookahead    Lookahead           blocks given ahead and mapped on another thread

This module has the manager's construction and the core operations (admission, growth, commit,
free, with their batched forms for an engine's step); every other public method checks nothing
itself and calls its part (docs/kv-cache.md has the picture and the rules).
"""

from __future__ import annotations

from typing import Sequence

from vmemkv import validation as check
from typing import Literal

import torch

from vmemkv.cache.kv_spec import KVCacheSpec, layer_specs
from vmemkv.cache.config import CacheConfig, CacheStats, PreemptionEstimate
from vmemkv.cache.coordinator import KVCacheCoordinator
from vmemkv.cache.events import KVEventSink, check_sink
from vmemkv.cache.group import KVCacheGroup
from vmemkv.cache.hashing import CacheKeys
from vmemkv.cache.layer_groups import LayerGroups, group_configs
from vmemkv.cache.lookahead import Lookahead
from vmemkv.cache.metrics import KVMetricsCollector, timed
from vmemkv.cache.plans import check_plans_budget
from vmemkv.cache.preemption import Preemption
from vmemkv.cache.queries import CacheQueries, GroupReads, KVCacheViews, PoolUsage
from vmemkv.cache.refusal import Refusal
from vmemkv.cache.registry import RequestRegistry, UnknownRequestError, WrongRequestStateError
from vmemkv.cache.request import KVRequest
from vmemkv.cache.sharing import Sharing
from vmemkv.errors import (ConfigError, InvalidInputError, ManagerClosedError, MappingLimitError,
                           RequestStateError, VmemkvError)
from vmemkv.memory.layout import KVLayout
from vmemkv.memory.slots import MapJob
from vmemkv.memory.vmm.base import VirtualMemoryBackend

_NO_TOKENS = ()  # allocate's default: nothing to check or append


class PrefixCacheBusyError(VmemkvError):
    """The prefix cache cannot be reset while requests hold blocks."""

__all__ = ["CacheConfig", "CacheStats", "KVCacheManager", "KVRequest", "PreemptionEstimate",
           "PrefixCacheBusyError", "Refusal", "UnknownRequestError", "WrongRequestStateError", "GroupReads"]


class KVCacheManager:
    """The scheduler-facing API, composed of its parts (``registry``, ``coordinator``,
    ``queries``, ``sharing``, ``preemption``, ``lookahead``: see the module's picture). This
    class holds the core (admission and growth, commit and prefix registration, freeing,
    close); each other method calls its part.

    ``KVCacheManager(config, backend=None, metrics=None, events=None, *, layer_windows=None,
    chunk_tokens=None, local_blocks=None, backends=None)``: ``backend`` defaults to the device's
    (``vmemkv.memory.vmm.create_backend``); ``metrics``, a ``vmemkv.KVMetricsCollector``, times the
    operations and the backend's mapping (``kv_metrics.py``; None costs about 0.15 µs per call);
    ``events``, a callable (e.g. ``vmemkv.KVEventBuffer``), is told every block stored in or
    removed from the prefix cache and every reset (``kv_events.py``; with several layer groups
    each event names its group, ``group_idx``).

    ``layer_windows`` gives each model layer's window (an int: a sliding window), its
    ``KVCacheSpec`` (``kv_spec.py``: e.g. ``ChunkedLocalSpec(C)``; an ``AttentionSpec(kind,
    size)`` makes one), None (full attention), ``NO_MEMORY`` (a layer with nothing to cache,
    in no group) or a pair ``(attention entry, RecurrentStateSpec)`` (a layer in an attention
    group and a state group: ``kv_views`` and ``state_views`` find each): one layer group per kind,
    each with its own virtual tensors and pool, the full-attention group first
    (``layout_groups``). ``config`` then describes the whole model: ``num_blocks`` blocks of all
    layers, whose bytes the groups share (``layer_groups.split_blocks``: each local group gets
    what its window needs at most, ``local_blocks`` when given, ``chunk_tokens`` being the most
    tokens one step computes); groups whose blocks have the same bytes share one pool
    (``memories``), whose blocks go to whichever group needs them, unless ``local_blocks`` fixes
    the local groups' shares; ``backends`` gives each pool's backend, a list or a callable taking
    the pool's config (tensor parallelism records them). Block counts (``num_blocks``, ``num_free_blocks``, ``blocks_for_tokens``, ...) are the
    first group's, the one that grows with a request; every operation checks every group."""

    def __init__(self, config: CacheConfig, backend: VirtualMemoryBackend | None = None,
                 metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None, *,
                 layer_windows: "Sequence[int | KVCacheSpec | None] | None" = None,
                 chunk_tokens: int | None = None, local_blocks: int | None = None,
                 backends: Sequence[VirtualMemoryBackend | None] | None = None):
        self.config = check.config(config)
        try:
            check.count(config.sliding_window, "CacheConfig.sliding_window", minimum=1, optional=True)
            check.count(config.attention_chunk_size, "CacheConfig.attention_chunk_size", minimum=1,
                        optional=True)
        except InvalidInputError as error:
            raise ConfigError(str(error)) from None
        if metrics is not None and not isinstance(metrics, KVMetricsCollector):
            raise ConfigError(f"metrics must be a vmemkv.KVMetricsCollector or None; got "
                              f"{type(metrics).__name__}")
        self.metrics = metrics  # times the operations (``timed``) and the backends' mapping
        self.events = check_sink(events)  # told what enters and leaves the prefix cache
        self.stats = CacheStats()
        self.coordinator = coordinator = KVCacheCoordinator(
            config, self.stats, backend, metrics, self.events, layer_windows=layer_windows,
            chunk_tokens=chunk_tokens, local_blocks=local_blocks, backends=backends)
        self.groups, self.memories, self.budget = coordinator.groups, coordinator.memories, coordinator.budget
        first = coordinator.first
        self.spec, self.window = first.spec, first.window  # the first group's (full attention if any)
        self.tokens_per_page = coordinator.tokens_per_page
        self.registry = RequestRegistry(self, config, self.tokens_per_page, len(self.groups))
        self.hasher = self.registry.hasher
        self.queries = CacheQueries(self.registry, coordinator, config, self.stats)
        self.sharing = Sharing(self.registry, coordinator, self.stats)
        self.preemption = Preemption(self.registry, coordinator, config, self.stats)
        self.lookahead = Lookahead(self.registry, coordinator, config)

    # --- the first group's parts (the only group's, for most models) ------------------------------
    @property
    def layout(self) -> KVLayout:
        """Where K and V sit in a slot and a block (frozen: read it, never replace it); the first
        group's (every group shares its dtype, head shapes and tokens per page)."""
        return self.coordinator.first.layout

    pool = property(lambda self: self.groups[0].pool)
    slots = property(lambda self: self.groups[0].slots)
    backend = property(lambda self: self.groups[0].backend)
    swap = property(lambda self: self.groups[0].swap)
    host_tier = property(lambda self: self.groups[0].host_tier)
    cold_tier = property(lambda self: self.groups[0].cold_tier)

    @property
    def last_refusal(self) -> Refusal | None:
        """Why the last refused call was refused (None before any refusal)."""
        return self.coordinator.last_refusal

    # --- invariants ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants (every block in one state, reference counts equal to the
        references held, no block writable by two requests or hashed while writable, no slot
        bound twice, no host row lost) over every group's pool and slots and every request, and
        that each request's allocations agree across the groups."""
        self.registry.check_open()
        requests = list(self.registry.requests.values())
        for req in requests:
            assert req.chain.owner is self, f"{req.request_id} belongs to another manager"
            assert len(req.allocations) == len(self.groups), f"{req.request_id}: allocations"
            first = req.allocation
            assert first is req.allocations[0]
            for group, other in zip(self.groups[1:], req.allocations[1:]):
                agree = (other.slot, other.num_tokens, other.num_computed, other.swapped is None)
                assert agree == (first.slot, first.num_tokens, first.num_computed,
                                 first.swapped is None), f"{req.request_id}: groups differ"
                if group.grows:  # a state group's blocks do not follow the tokens
                    assert (other.num_registered, len(other.blocks)) == (
                        first.num_registered, len(first.blocks)), f"{req.request_id}: groups differ"
        self.coordinator.check(requests)

    @classmethod
    def for_layers(cls, config: CacheConfig, layer_windows, chunk_tokens: int | None = None,
                   metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None,
                   backends=None) -> "KVCacheManager":
        """A manager with one layer group per kind of ``layer_windows`` (each layer's window,
        ``KVCacheSpec`` or None), or with one group of every layer (keeping every block) when
        ``layer_windows`` is None or the groups' pages cannot hold one number of tokens.
        ``backends``: makes a pool's backend from the pool's config (or None: each its own)."""
        if layer_windows and any(specs[1] or not specs[0] for specs in map(layer_specs, layer_windows)):
            return cls(config, metrics=metrics, events=events, layer_windows=layer_windows,
                       chunk_tokens=chunk_tokens, backends=backends)  # state or memoryless layers: own groups
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
        self.registry.check_open()
        req = self.registry.admission_request(request, token_ids, keys)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens", optional=True)
        token_budget = check.count(token_budget, "token_budget", optional=True)
        slot = check.slot_index(slot, self.num_slots)
        max_cached_tokens = check.count(max_cached_tokens, "max_cached_tokens", optional=True)
        admissions = self._admission(req, num_new_tokens, token_budget, max_cached_tokens)
        groups = self.groups
        needs, hits, fits = self.coordinator.admission_fits(admissions, slot)
        if not fits:
            return self.coordinator.refused("admit", req, slot, needs, hits)
        fresh = self.coordinator.peek(needs, hits)
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
        claimed = self.coordinator.claim([admission.promote for admission in admissions])
        self.coordinator.take([plan.take for plan in plans])
        for group, alloc, admission, plan in zip(groups, req.allocations, admissions, plans):
            group.finish_admit(alloc, admission, plan, claimed[group.index])
        self._count_admission(req, admissions[0])
        return admissions[0].cached

    def _admission(self, req: KVRequest, num_new_tokens: int | None, token_budget: int | None,
                   max_cached_tokens: int | None) -> list:
        """What ``admit`` of ``req`` reuses and reserves in each group (arguments checked by the
        caller): the longest prefix every group reuses, from the device and then the host tiers;
        raises for a request already admitted or too long. Changes nothing but binding ``req``'s
        hash chain to this manager."""
        request_id, num_prompt, tokens_per_page = req.request_id, len(req.token_ids), self.tokens_per_page
        if request_id in self.registry.requests:
            raise RequestStateError(f"request {request_id!r} is already admitted")
        self.registry.check_length(request_id, num_prompt)
        self.registry.own(req)
        hits = self.queries.prefix_hits(req)
        limit = None if max_cached_tokens is None else max_cached_tokens // tokens_per_page
        if limit is not None and len(hits[0]) > limit:
            hits = self.coordinator.common_hits(req.chain.hashes, hits, limit)
        admissions = self.coordinator.admissions(req.chain.hashes, num_prompt, hits, num_new_tokens,
                                                 token_budget, limit, not req.exact)
        self.registry.check_length(request_id, admissions[0].num_tokens)
        return admissions

    def _count_admission(self, req: KVRequest, admission) -> None:
        """Register an admitted request and count its prefix hit."""
        num_prompt, cached = len(req.token_ids), admission.cached
        repeat = self.registry.add(req)
        if not self.config.enable_prefix_caching:
            return
        stats = self.stats
        if repeat:
            stats.reprefill_queried_tokens += num_prompt
            stats.reprefill_hit_tokens += cached
            return
        tokens_per_page = self.tokens_per_page
        lower = admission.host_blocks * tokens_per_page  # from the host and cold tiers
        cold = admission.cold_blocks * tokens_per_page
        stats.prefix_queried_tokens += num_prompt
        stats.prefix_hit_tokens += cached
        stats.prefix_hit_tokens_device += cached - lower
        stats.prefix_hit_tokens_host += lower - cold
        stats.prefix_hit_tokens_cold += cold
        tokens = req.token_ids
        hit_blocks = cached // tokens_per_page
        stats.prefix_partial_page_tokens += self.groups[0].pool.shared_partial_tokens(
            req.chain.hashes[hit_blocks - 1] if hit_blocks else self.registry.chain_root(req.keys),
            tokens[cached:min(cached + tokens_per_page, len(tokens) - 1)])

    @timed
    def allocate(self, request: "KVRequest | str", num_new_tokens: int,
                 new_token_ids: Sequence[int] = _NO_TOKENS) -> bool:
        """Reserve ``num_new_tokens`` more positions (mapping a block only when crossing a block
        boundary), appending ``new_token_ids`` to the request's token ids (a KVRequest's owner may
        append them itself instead). Returns False, changing nothing, when the blocks are not
        there in every layer group."""
        req = self.registry.running(request)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        if new_token_ids is not _NO_TOKENS:
            new_token_ids = self.registry.token_ids(new_token_ids, "new_token_ids")
        total = req.allocation.num_tokens + num_new_tokens
        if total > self.config.max_model_len:
            self.registry.check_length(req.request_id, total)
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
        needed = -(-total // tokens_per_page) - len(first.blocks)  # as many in every growing group
        needs = [needed if group.grows else 0 for group in groups]
        if needed > 0 and not self.coordinator.fits(needs):
            self.coordinator.short_of_blocks("allocate", req, first.slot, needs)
            return False
        if -(-total // tokens_per_page) <= -(-first.num_tokens // tokens_per_page):
            for alloc in allocs:  # a decode inside its block (the engine's): nothing to map or take
                alloc.grow(num_new_tokens)
        else:
            fresh = self.coordinator.peek(needs) if needed > 0 else [[]] * len(groups)
            plans = [group.plan_grow(alloc, num_new_tokens, fresh[group.index])
                     for group, alloc in zip(groups, allocs)]
            if len(groups) > 1:
                check_plans_budget(groups, plans, "allocate")
            for group, plan in zip(groups, plans):
                group.map_grow(plan)  # the one refusable step
            self.coordinator.take(fresh)
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
        reqs = [self.registry.running(request) for request in requests]
        counts = [check.count(count, "num_new_tokens") for count in counts]
        for req, count in zip(reqs, counts):
            if req.allocation.num_tokens + count > self.config.max_model_len:
                self.registry.check_length(req.request_id, req.allocation.num_tokens + count)
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
        req = self.registry.running(request)
        done = req.allocation.num_tokens if num_computed_tokens is None else check.count(
            num_computed_tokens, "num_computed_tokens")
        self._check_commit(req, done)
        self._commit(req, done)

    @timed
    def commit_all(self, requests: "Sequence[KVRequest | str]") -> None:
        """``commit(request)`` for each request (every reserved position written), as one
        operation (an engine's step: one call, not one per sequence through the timing
        wrapper). Every request is checked before any is committed."""
        reqs = [self.registry.running(request) for request in requests]
        tokens_per_page, caching = self.tokens_per_page, self.config.enable_prefix_caching
        for req in reqs:  # _check_commit, called only where it has something to check
            allocation = req.allocation
            done = allocation.num_tokens
            if (not allocation.num_computed <= done <= len(req.token_ids)
                    or (caching and done // tokens_per_page * tokens_per_page > req.chain.num_checked)):
                self._check_commit(req, done)
        releases = self.coordinator.releases
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
            self.registry.check_tokens(req, end)

    def _commit(self, req: KVRequest, done: int) -> None:
        full = done // self.tokens_per_page
        if self.config.enable_prefix_caching and full > req.allocation.num_registered:
            hashes = self.registry.extend_chain(req, full)  # its tokens were checked by _check_commit
            root = self.registry.chain_root(req.keys) if not req.allocation.num_registered else None
            self.coordinator.register_full(req.allocations, full, req.token_ids, hashes, root)
            self.coordinator.save_states(req.allocations, done, hashes, req.token_ids)
        for alloc in req.allocations:
            alloc.commit(done)
        if self.coordinator.releases:
            for group, alloc in zip(self.groups, req.allocations):
                group.release_behind_window(alloc)  # a no-op for kinds that read every position

    # --- freeing ------------------------------------------------------------------------------------
    @timed
    def free(self, request: "KVRequest | str") -> None:
        """Release a request (running or swapped). Its blocks go back deepest first, so a shared
        prefix outlives its tails in the LRU queue; its slot keeps its mappings. A KVRequest keeps
        its token ids and hash chain and may be admitted again."""
        registry = self.registry
        registry.check_open()
        req = registry.holds(request)
        if req is None:
            registry.known(request)  # raises what is wrong with it
        registry.remove(req.request_id)
        for group, alloc in zip(self.groups, req.allocations):
            group.free(alloc)

    @timed
    def discard(self, request: "KVRequest | str") -> None:
        """Forget a request for good, in whatever state it is (an abort): free what it holds;
        a request preempted by recompute holds nothing and is just forgotten; an unknown id is
        ignored."""
        self.registry.check_open()
        if isinstance(request, KVRequest):
            self.registry.check_not_foreign(request)
            request_id = request.request_id
            held = self.registry.holds(request) is not None
        else:
            request_id = check.request_id(request)
            held = self.registry.holds(request_id) is not None
        self.registry.forget_preempted(request_id)
        if held:
            self.free(request)

    @timed
    def reset_prefix_cache(self) -> int:
        """Forget all cached content (every group's, and the host tiers'). Refused while any
        request holds blocks (their hashes would go stale mid-flight). Returns how many cached
        blocks (of the first group) were dropped."""
        self.registry.check_open()
        for memory in self.memories:
            if memory.pool.num_in_use:
                raise PrefixCacheBusyError(
                    f"cannot reset the prefix cache: {memory.pool.num_in_use} blocks "
                    f"{memory.groups[0].in_group()}are held by {len(self.registry.requests)} request(s); "
                    "free or finish them first")
        dropped = [memory.pool.reset_cache() + memory.host_tier.clear() + memory.cold_tier.clear()
                   for memory in self.memories]
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
        self.registry.check_open()
        keep_blocks = check.count(keep_blocks, "keep_blocks")
        if type(cached) is not bool:
            raise InvalidInputError(f"cached must be True or False, got {cached!r}")
        return sum(memory.give_back(keep_blocks, cached) * memory.layout.block_bytes
                   for memory in self.memories)

    def close(self) -> None:
        """Give the memory back; every later call raises ManagerClosedError. Refused while
        tensors viewing the memory (from kv_views/block_views) are still held: reading one
        after close would crash the process. Closing twice does nothing."""
        if self.registry.closed:
            return
        held = self.coordinator.views_in_use()
        if held:
            raise ManagerClosedError(
                f"cannot close the KV cache manager: {held} reference(s) to its K/V views (from "
                "kv_views/block_views, or tensors and arrays made from them) are still held; "
                "drop them first, since reading them after close would crash the process")
        self.registry.closed = True
        self.coordinator.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.coordinator.views_in_use():
            return  # closing would raise and hide the error in flight; the views stay readable
        self.close()

    # --- preemption (preemption.py) ----------------------------------------------------------------
    @timed
    def preempt(self, request: "KVRequest | str", mode: Literal["recompute", "swap", "auto"] = "auto") -> str:
        """Take a running request off the device; returns the mode used.

        recompute: its blocks are released (cached ones may be hit when it is admitted again with
        all its tokens). swap: its private blocks are copied to host swap space and released;
        blocks shared with other requests stay referenced; ``swap_in`` brings it back
        (OutOfSwapSpaceError, changing nothing, when some group's swap space is short). A
        KVRequest preempted by recompute keeps its token ids and hash chain for its
        re-admission."""
        req = self.registry.running(request)
        self.registry.require_committed(req)
        mode = check.choice(mode, "preemption mode", check.PREEMPT_MODES)
        if mode == "auto":
            mode = self.estimate_preemption(req).cheaper
        if mode == "recompute":
            self.free(req)
            self.registry.mark_preempted(req.request_id)
            self.stats.preemptions_recompute += 1
            return mode
        self.preemption.swap_out(req)
        return mode

    @timed
    def estimate_preemption(self, request: "KVRequest | str") -> PreemptionEstimate:
        """What swapping costs (every group's private blocks) and what recomputing costs (the
        tokens past a prefix other requests keep alive in the first group)."""
        return self.preemption.estimate(request)

    def can_swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Whether ``swap_in`` (into ``slot`` when given) would find a slot and the blocks now."""
        return self.preemption.can_swap_in(request, slot)

    @timed
    def swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Bring a swapped request back into any free slot (``slot`` when given), bit-exact, in
        every group. Returns False, changing nothing, without a free slot or enough blocks
        (MappingLimitError, changing nothing, when the mapping budget does not take it)."""
        return self.preemption.swap_in(request, slot)

    # --- overlapped mapping (lookahead.py) -----------------------------------------------------------
    @timed
    def allocate_lookahead(self, requests: "Sequence[KVRequest | str]", margin_tokens: int,
                           keep_free: int = 0) -> list[MapJob]:
        """Give each request whose reservation ends within ``margin_tokens`` of its last block's
        end the blocks that cover ``margin_tokens`` more positions (never past ``max_model_len``)
        now, without mapping them, while more than ``keep_free`` blocks stay free (of the first
        group's pool; every other pool keeps the same share of its blocks free). Only clean blocks
        are taken, so no cached prefix is evicted for a guess. Returns the jobs for
        ``map_lookahead`` (each names its group), which may run on another thread while the
        device computes: it touches only mapping state, and only pages past every reserved
        position."""
        return self.lookahead.allocate(requests, margin_tokens, keep_free)

    def map_lookahead(self, jobs: list[MapJob]) -> None:
        """Map the jobs of ``allocate_lookahead``, all or none in each group. If this raises,
        call ``cancel_lookahead(jobs)`` on the step thread before the requests grow again: every
        group gives its blocks back (a group that had mapped its jobs keeps those mappings, past
        every reservation: stale, as a freed slot's, and remapped before anyone writes there).
        With a metrics collector, its backend mapping counts as background mapping (not an
        operation of the step thread)."""
        if self.metrics is None:
            self.lookahead.map(jobs)
            return
        with self.metrics.background():
            self.lookahead.map(jobs)

    @timed
    def cancel_lookahead(self, jobs: list[MapJob]) -> None:
        """Give back the blocks of lookahead jobs whose mapping was refused; call it right after
        ``map_lookahead`` raised, before the requests change."""
        return self.lookahead.cancel(jobs)

    # --- sharing: fork, reorder, truncate (sharing.py) ----------------------------------------------
    @timed
    def fork(self, parent: "KVRequest | str", child: "KVRequest | str",
             slot: int | None = None) -> KVRequest | None:
        """Start ``child`` as a copy of ``parent`` in another slot (``slot`` when given): full
        blocks shared, the partial last block copied. ``child`` is a KVRequest not admitted yet
        (its token ids become a copy of the parent's, in its own list, and its keys the parent's)
        or a new id, for which the manager makes one. Returns the child's KVRequest, or None,
        changing nothing, without a slot (or not ``slot``) or a block in every layer group
        (MappingLimitError, changing nothing, when the mapping budget does not take it)."""
        return self.sharing.fork(parent, child, slot)

    @timed
    def reorder(self, requests: "Sequence[KVRequest | str]", sources: "Sequence[KVRequest | str]") -> bool:
        """Beam-search reorder: request ``requests[i]`` becomes a copy of ``sources[i]`` (as they
        were before the call). Full blocks are remapped, never copied; a partial block is copied
        only when more than one request takes it. Each request keeps its object and its token
        list, whose contents are replaced; each row keeps its window (pages behind its source's
        window stay released). Returns False, changing nothing, when the copies need more free
        blocks than some layer group has (MappingLimitError, changing nothing, when the mapping
        budget does not take every group's remapping)."""
        return self.sharing.reorder(requests, sources)

    @timed
    def truncate(self, request: "KVRequest | str", num_tokens: int) -> bool:
        """Forget every position from ``num_tokens`` on (rejected speculative tokens, a cropped
        cache). Blocks past the new end are released; if the new last block is partial and shared
        or cached, it is copied to a private block first, since the request will write it again.
        RequestStateError, changing nothing, when a windowed group's query at ``num_tokens``
        would read positions already released; False, changing nothing, when a copy finds no
        free block (MappingLimitError, changing nothing, when the mapping budget does not take
        every group's copy)."""
        return self.sharing.truncate(request, num_tokens)

    @timed
    def can_truncate(self, requests: "Sequence[KVRequest | str]", num_tokens: int) -> bool:
        """Whether ``truncate(r, num_tokens)`` for every ``r`` of ``requests``, one after another,
        finds a free block for every copy it makes in every group (each request checked as
        ``truncate`` checks it: RequestStateError). Changes nothing."""
        return self.sharing.can_truncate(requests, num_tokens)

    # --- queries, sizes, views and stats (queries.py) -------------------------------------------------
    def aligned_chunk_end(self, computed: int, end: int, num_tokens: int) -> int:
        """Where a prefill chunk from ``computed`` to at most ``end`` of a request's
        ``num_tokens`` tokens should end so that a model's recurrent state is saved for prefix
        hits (``CacheConfig.state_cache_interval``): the last save position up to ``end`` before
        the last token, if past ``computed``; else ``end`` (always, for models without state)."""
        return self.coordinator.aligned_chunk_end(computed, end, num_tokens)

    def views(self) -> KVCacheViews:
        """A read-only view of this manager for a step's addressing and attention."""
        self.registry.check_open()
        return KVCacheViews(self, self.queries)

    @property
    def num_free_slots(self) -> int:
        return self.queries.num_free_slots

    @timed
    def usage(self) -> float:
        """Fraction of blocks held by requests (of the fullest pool)."""
        return self.queries.usage()

    @timed
    def match_prefix(self, token_ids: "Sequence[int] | KVRequest",
                     keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of ``token_ids`` (whole blocks, leaving at least one
        token to compute) and the hashes of all full blocks of ``token_ids``. With a sliding
        window, the longest prefix whose blocks its next query's window reads are cached, with
        ``RELEASED`` (-1) for the blocks before that window (they need not be cached); with
        several layer groups, the first group's blocks of the longest prefix every group can
        reuse. Given a KVRequest, its own tokens and keys, and its hash chain (extended, never
        recomputed). Lossy blocks (the cold tier's) count unless the KVRequest is ``exact``, as
        for ``admit``."""
        return self.queries.match_prefix(token_ids, keys)

    @timed
    def can_admit(self, token_ids: "Sequence[int] | KVRequest", keys: CacheKeys = CacheKeys()) -> bool:
        """Whether ``admit`` of all of ``token_ids`` (or of a KVRequest) would succeed now."""
        return self.queries.can_admit(token_ids, keys)

    @timed
    def can_allocate(self, request: "KVRequest | str", num_new_tokens: int) -> bool:
        return self.queries.can_allocate(request, num_new_tokens)

    @timed
    def blocks_needed(self, request: "KVRequest | str", num_new_tokens: int) -> int:
        """New blocks of the first group's pool for ``num_new_tokens`` more positions (as many
        for every group drawing from it)."""
        return self.queries.blocks_needed(request, num_new_tokens)

    def blocks_to_grow(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> list[int]:
        """For each pool (``pool_usage`` order): the new blocks growing each running request
        ``requests[i]`` by ``counts[i]`` positions takes, in every group drawing from the pool
        (an all-or-nothing check of several requests' growth against ``blocks_free``)."""
        return self.queries.blocks_to_grow(requests, counts)

    def fragmentation(self, requests: "Sequence[KVRequest]") -> tuple[int, int]:
        """(Bytes of the blocks in use beyond the bytes the tokens of ``requests`` fill, those
        bytes): each pool counted with its own blocks and clipped at zero; tokens in blocks
        given back behind a window are neither. An estimate: blocks in use include lookahead
        blocks and swapped requests' shared ones, and a prefix shared by several requests is one
        block but counted in each one's tokens."""
        return self.queries.fragmentation(requests)

    def pool_usage(self) -> list[PoolUsage]:
        """Each pool's blocks in use, free and copied, and its block bytes (one pool for most
        models; a hybrid model's groups of different block bytes have one each)."""
        return self.queries.pool_usage()

    @property
    def num_blocks(self) -> int:
        """Blocks (logical pages) in the first group's pool (every group's, when they share one)."""
        return self.queries.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: clean ones and cached ones (evicted when taken), less,
        with a shared KV budget, the clean ones its free bytes would not back."""
        return self.queries.num_free_blocks

    @property
    def num_blocks_in_use(self) -> int:
        return self.queries.num_blocks_in_use

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks held by requests, in every group."""
        return self.queries.kv_bytes_in_use

    @property
    def kv_bytes_resident(self) -> int:
        """Bytes of the blocks with memory behind them, in every pool: held, cached, and free
        clean blocks not given back (``release_free_memory``)."""
        return self.queries.kv_bytes_resident

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding prefix-cache content."""
        return self.queries.num_cached_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all (the first group's) layers' K and V of ``tokens_per_page`` tokens."""
        return self.queries.block_bytes

    @property
    def num_slots(self) -> int:
        return self.queries.num_slots

    @property
    def layout_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layer groups, each with its own virtual tensors (one for most models); groups
        whose blocks have the same bytes draw from one pool (``memories``)."""
        return self.queries.layout_groups

    def layer_group(self, layer: int) -> KVCacheGroup:
        """The layer group holding model layer ``layer`` (its ``spec`` is the layer's rule)."""
        return self.queries.layer_group(layer)

    def free_slots(self) -> list[int]:
        return self.queries.free_slots()

    def is_slot_free(self, slot: int) -> bool:
        return self.queries.is_slot_free(slot)

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once. With a sliding
        window and ``chunk_tokens`` (the most tokens computed in one step: a prefill chunk),
        blocks behind the window are released as it runs, so it holds about the window plus a
        chunk (``KVCacheSpec.peak_blocks``); otherwise every block of its tokens. Counted in the
        first group's pool: with groups sharing it, the blocks of all of them."""
        return self.queries.blocks_for_tokens(num_tokens, chunk_tokens)

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None:
        """None when a request of ``num_tokens`` tokens (computed in chunks of at most
        ``chunk_tokens``, as ``blocks_for_tokens``) fits once nothing else is held; otherwise
        which limit it exceeds and what to change."""
        return self.queries.why_never_fits(num_tokens, chunk_tokens)

    def can_ever_fit(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        """Whether a request of ``num_tokens`` tokens fits once nothing else is held."""
        return self.queries.can_ever_fit(num_tokens, chunk_tokens)

    def cache_stats(self) -> CacheStats:
        """A copy of the counters (prefix hits, preemptions, swap bytes, forks, block copies)."""
        return self.queries.cache_stats()

    def batched_reads(self):
        """What CPU attention needs to read several consecutive slots in one call
        (``make_readable``, ``release_reads``, ``num_layers``: ``attention.contiguous.SlotReads``)."""
        return self.queries.batched_reads()

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``layer``'s K and V over every slot, ``[num_slots, max_model_len, kv_heads,
        dim]``, from its group's virtual tensors (vmem only). Touch only positions below a
        request's reservation."""
        return self.queries.kv_views(layer)

    def kv_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With ``kv_cache_dtype`` "int8" or "fp8": the float32 scales of layer ``layer``'s K and V
        rows over every slot, ``[num_slots, max_model_len, kv_heads, groups]`` (one per 32 values of a
        row), in the same pages as the values (``kv_views`` then holds int8 / float8_e4m3fn bytes;
        value = byte x its group's scale, ``memory/quantized_rows.py``). None when K/V are stored in
        the model's dtype."""
        return self.queries.kv_scale_views(layer)

    def state_views(self, layer: int) -> list[torch.Tensor]:
        """Model layer ``layer``'s recurrent state over every slot: per part of its
        ``RecurrentStateSpec``, a tensor ``[num_slots, *part.shape]`` in the part's dtype, each
        slot's parts contiguous in its state pages. Touch only the slots of running requests (a
        request's state is zero when it is admitted)."""
        return self.queries.state_views(layer)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as block tensors ``[num_blocks, tokens_per_page, kv_heads,
        dim]`` of its group's pool, addressed through ``block_table(request, layer)`` (both
        backends)."""
        return self.queries.block_views(layer)

    def block_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With ``kv_cache_dtype`` "int8" or "fp8": the float32 scales of layer ``layer``'s K and V
        rows as block tensors ``[num_blocks, tokens_per_page, kv_heads, groups]``, beside
        ``block_views`` (both backends); None when K/V are stored in the model's dtype."""
        return self.queries.block_scale_views(layer)

    def request(self, request_id: str) -> KVRequest:
        """The admitted (running or swapped) request of this id: the caller's KVRequest, or the
        one ``admit`` made for an id."""
        return self.queries.request(request_id)

    @timed
    def slot_of(self, request: "KVRequest | str") -> int:
        return self.queries.slot_of(request)

    @timed
    def num_tokens(self, request: "KVRequest | str") -> int:
        return self.queries.num_tokens(request)

    def num_computed_tokens(self, request: "KVRequest | str") -> int:
        return self.queries.num_computed_tokens(request)

    @timed
    def block_table(self, request: "KVRequest | str", layer: int | None = None) -> list[int]:
        """The request's blocks (in layer ``layer``'s group; default: the first group)."""
        return self.queries.block_table(request, layer)

    def token_ids(self, request: "KVRequest | str") -> list[int]:
        """A copy of the request's token ids (a KVRequest's own list is ``request.token_ids``)."""
        return self.queries.token_ids(request)

    def is_swapped(self, request: "KVRequest | str") -> bool:
        return self.queries.is_swapped(request)

    def request_ids(self) -> list[str]:
        return self.queries.request_ids()

    def snapshot_stats(self) -> dict:
        """The counters and the first group's pool and mapping counts; with several layer groups,
        each later group's block counts beside them (``group<i>_blocks_*``) and
        ``kv_bytes_in_use`` over all."""
        return self.queries.snapshot_stats()
