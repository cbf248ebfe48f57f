"""What every part of the KV cache manager shares: its layer groups, its requests, and the small
steps the operations are built from.

The manager is a coordinator over one or more :class:`KVCacheGroup` (``cache_group.py``), one per
attention kind among the model's layers (full attention, a sliding window, attention chunks), as
vLLM v1's ``KVCacheCoordinator`` over its single-type managers. A model whose layers read alike
has one group; Gemma-2/3, GPT-OSS, Cohere2 and Llama-4 have two. Every group has its own virtual
tensors and pool; all of them share one slot index, one hash chain per request and one set of
counters. A request is the caller's :class:`vmemkv.KVRequest` (``request.py``): its hash chain and
its allocations (``request.allocations``, one :class:`Allocation` per group, the same counts in
each) only the manager changes, through their transitions. ``_requests`` registers the admitted
ones by id, for callers that name a request by its id and for the invariant check.

``KVCacheManager`` (``manager.py``) is this state plus three groups of operations, each in its own
module: the core (admit, allocate, commit, free, queries) in ``manager.py``, sharing (fork,
reorder, truncate) in ``sharing.py``, preemption (estimate, preempt, swap in) in ``preemption.py``,
overlapped mapping in ``lookahead.py``. Every mutating operation plans in every group first
(``KVCacheGroup.plan_*``), checks every plan (blocks, slots, swap room, and the process's mapping
budget over every group's mapper: ``plans.check_mapping_budget``), and only then changes anything,
so a refusal leaves nothing half done in any group.

The parts of the first group (``pool``, ``slots``, ``backend``, ``swap``, ``host_tier``) are
attributes for the manager's own modules, its tests and benchmarks (``layout_groups`` lists every
group); code that *uses* a manager (the engine, the integrations) asks its public queries instead
(``num_free_blocks``, ``blocks_for_tokens``, ``can_ever_fit``, ``cache_stats``, ...). ``layout``
is public and read-only: a frozen description of where K and V sit, which attention needs anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from vmemkv import validation as check
from vmemkv.cache.attention_spec import CHUNKED, AttentionSpec
from vmemkv.cache.config import CacheConfig, CacheStats
from vmemkv.cache.group import KVCacheGroup
from vmemkv.cache.memory import KVMemory
from vmemkv.errors import (ConfigError, InvalidInputError, ManagerClosedError, RequestStateError,
                           RequestTooLongError, VmemkvError)
from vmemkv.cache.hashing import CacheKeys, PrefixHasher
from vmemkv.cache.events import KVEventSink, check_sink, group_sink, shared_sink
from vmemkv.cache.metrics import KVMetricsCollector
from vmemkv.cache.layer_groups import LayerGroups, group_configs
from vmemkv.memory.budget import SharedKVBudget
from vmemkv.memory.layout import KVLayout
from vmemkv.cache.refusal import Refusal
from vmemkv.cache.request import KVRequest
from vmemkv.memory.vmm.base import VirtualMemoryBackend


class PrefixCacheBusyError(VmemkvError):
    """The prefix cache cannot be reset while requests hold blocks."""


class UnknownRequestError(VmemkvError, KeyError):
    """No request with this id is known to the manager (not admitted: new, freed, or preempted
    by recompute)."""

    def __str__(self) -> str:  # the message as written, not quoted as a KeyError's key
        return str(self.args[0]) if self.args else ""


class WrongRequestStateError(RequestStateError, UnknownRequestError):
    """An admitted request that is not in the state the call needs: ``swap_in`` of a running
    request, ``allocate`` of a swapped-out one. Also an ``UnknownRequestError``, as these were
    before, so code catching that still catches them."""


class ManagerState:
    """The manager's groups and requests, built from a :class:`CacheConfig`, and the invariant
    check over them."""

    config: CacheConfig
    groups: tuple[KVCacheGroup, ...]
    tokens_per_page: int
    hasher: PrefixHasher
    stats: CacheStats
    metrics: KVMetricsCollector | None  # timing of operations and mapping (kv_metrics.py)

    def __init__(self, config: CacheConfig, backend: VirtualMemoryBackend | None = None,
                 metrics: KVMetricsCollector | None = None, events: KVEventSink | None = None, *,
                 layer_windows: "Sequence[int | AttentionSpec | None] | None" = None,
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
        self.metrics = metrics
        self.events = check_sink(events)  # told what enters and leaves the prefix cache
        self.stats = CacheStats()
        self.last_refusal: Refusal | None = None  # why the last refused call was refused
        layers, configs = self._group_layers(config, layer_windows, chunk_tokens, local_blocks)
        # each memory with the indices of the groups drawing from it, for the steps over memories
        self._members = tuple((memory, tuple(indices)) for memory, indices in self._memories(
            configs, [spec for _, spec in layers], local_blocks is None, backend, backends, metrics))
        self.memories = tuple(memory for memory, _ in self._members)
        memory_of = {index: memory for memory, indices in self._members for index in indices}
        self.groups = tuple(KVCacheGroup(index, group_config, group_layers, spec, memory_of[index])
                            for index, ((group_layers, spec), group_config)
                            in enumerate(zip(layers, configs)))
        for group in self.groups:  # every mapper's views exist now: the references are the manager's
            group.slots.count_own_references()
        first = self.groups[0]
        self.spec, self.window = first.spec, first.window  # the first group's (full attention if any)
        self._layout = first.layout
        self.tokens_per_page = first.tokens_per_page
        self._releases = any(group.spec.releases for group in self.groups)
        self._where = {layer: (group, index) for group in self.groups
                       for index, layer in enumerate(group.layers)}  # model layer -> group, its index
        self.hasher = PrefixHasher(config.hash_algorithm, config.hash_seed)
        self._chain_root = functools.lru_cache(256)(self.hasher.root)  # keys -> root hash, 1 µs saved
        self._requests: dict[str, KVRequest] = {}  # admitted (running or swapped), by id
        self._preempted: set[str] = set()  # recompute-preempted ids, to count their re-prefill
        self._closed = False

    @staticmethod
    def _group_layers(config: CacheConfig, layer_windows, chunk_tokens, local_blocks):
        """``([(layers, spec)] per group, [CacheConfig] per group)``: one group of every layer by
        ``config``'s window or chunks, or the groups of ``layer_windows`` (each layer's window,
        its ``AttentionSpec``, or None: full attention)."""
        if layer_windows is None:
            spec = AttentionSpec.of(config.sliding_window, config.attention_chunk_size)
            return [(tuple(range(config.num_layers)), spec)], [config]
        if len(layer_windows) != config.num_layers:
            raise ConfigError(f"layer_windows has {len(layer_windows)} entries for "
                              f"{config.num_layers} layers")
        if config.sliding_window or config.attention_chunk_size:
            raise ConfigError("give windows or chunks per layer (layer_windows) or for every layer "
                              "(CacheConfig.sliding_window or attention_chunk_size), not both")
        groups = LayerGroups.from_windows(layer_windows)
        return list(zip(groups.layers, groups.specs)), group_configs(config, groups, chunk_tokens,
                                                                     local_blocks)

    def _memories(self, configs: list[CacheConfig], specs: list[AttentionSpec], share: bool,
                  backend, backends, metrics) -> list[tuple[KVMemory, list[int]]]:
        """The memories behind the groups, each with the indices of the groups it serves: one for
        all groups of one block layout when ``share`` (no fixed ``local_blocks``), holding the
        blocks of all of them; else one each. ``backends``: one per memory (a list), or a callable
        making one from a memory's config; ``backend``: the first memory's."""
        layouts: dict = {}  # layout -> group indices
        for index, group_config in enumerate(configs):
            layout = group_config.make_layout()
            layouts.setdefault(layout if share else index, []).append(index)
        memories = []
        self.budget = self._join_budget(max(c.make_layout().block_bytes for c in configs))
        try:  # a refused construction leaves the budget as it was
            for position, indices in enumerate(layouts.values()):
                memory_config = configs[indices[0]]
                if len(indices) > 1:  # the bytes of every member's blocks, in one pool
                    memory_config = dataclasses.replace(
                        memory_config, num_blocks=sum(configs[i].num_blocks for i in indices),
                        swap_space_bytes=sum(configs[i].swap_space_bytes for i in indices),
                        host_cache_bytes=sum(configs[i].host_cache_bytes for i in indices),
                        sliding_window=next((specs[i].window for i in indices if specs[i].window), None),
                        attention_chunk_size=next((specs[i].size for i in indices
                                                   if specs[i].kind == CHUNKED), None))
                if callable(backends):
                    memory_backend = backends(memory_config)
                elif backends is not None:
                    if len(backends) != len(layouts):
                        raise ConfigError(f"{len(backends)} backends for {len(layouts)} memories of "
                                          "layer groups")
                    memory_backend = backends[position]
                else:
                    memory_backend = backend if position == 0 else None
                sink = self._sink([(i, specs[i]) for i in indices], len(configs))
                memories.append((KVMemory(memory_config, self.stats, memory_backend, sink, metrics,
                                          self.budget), indices))
        except BaseException:
            if self.budget is not None:
                self.budget.close()
            raise
        return memories

    def _join_budget(self, block_bytes: int) -> SharedKVBudget | None:
        """The shared KV budget ``config.kv_pool``, if any, refused if it cannot pay for one
        block (``block_bytes`` of every rank's pages)."""
        config = self.config
        if config.kv_pool is None:
            return None
        ranks = config.kv_pool_ranks
        if type(ranks) is not int or ranks < 1:
            raise ConfigError(f"kv_pool_ranks must be a positive int, got {ranks!r}")
        return SharedKVBudget(config.kv_pool, config.kv_pool_bytes, block_bytes=block_bytes * ranks)

    def _sink(self, members: list[tuple[int, AttentionSpec]], num_groups: int):
        """The events sink of a memory serving ``members`` (group index, spec): the manager's own
        for a one-group model, each event tagged with its group otherwise."""
        if num_groups == 1:
            return self.events
        if len(members) == 1:
            index, spec = members[0]
            return group_sink(self.events, index, spec.window, chunked=spec.kind == CHUNKED)
        return shared_sink(self.events, [(index, spec.window, spec.kind == CHUNKED) for index, spec in members])

    # --- the first group's parts (the only group's, for most models) ------------------------------
    @property
    def layout(self) -> KVLayout:
        """Where K and V sit in a slot and a block (frozen: read it, never replace it); the first
        group's (every group shares its dtype, head shapes and tokens per page)."""
        return self._layout

    pool = property(lambda self: self.groups[0].pool)
    slots = property(lambda self: self.groups[0].slots)
    backend = property(lambda self: self.groups[0].backend)
    swap = property(lambda self: self.groups[0].swap)
    host_tier = property(lambda self: self.groups[0].host_tier)

    # --- invariants ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants (every block in one state, reference counts equal to the
        references held, no block writable by two requests or hashed while writable, no slot
        bound twice, no host row lost) over every group's pool and slots and every request, and
        that each request's allocations agree across the groups."""
        self._check_open()
        requests = list(self._requests.values())
        for req in requests:
            assert req.chain.owner is self, f"{req.request_id} belongs to another manager"
            assert len(req.allocations) == len(self.groups), f"{req.request_id}: allocations"
            first = req.allocation
            assert first is req.allocations[0]
            for other in req.allocations[1:]:
                assert (other.slot, other.num_tokens, other.num_computed, other.num_registered,
                        len(other.blocks), other.swapped is None) == (
                    first.slot, first.num_tokens, first.num_computed, first.num_registered,
                    len(first.blocks), first.swapped is None), f"{req.request_id}: groups differ"
        results = {group.index: group.check([(req.request_id, req.allocations[group.index],
                                              len(req.chain.hashes)) for req in requests])
                   for group in self.groups}
        bound = [slots for slots, _, _ in results.values()]
        assert all(slots == bound[0] for slots in bound), "the groups bind different slots"
        for memory in self.memories:
            memory.check([b for group in memory.groups for b in results[group.index][1]],
                         [row for group in memory.groups for row in results[group.index][2]])
        free = [sorted(group.slots.free_slots()) for group in self.groups]
        assert all(slots == free[0] for slots in free), "the groups have different free slots"

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
            raise WrongRequestStateError(f"request {req.request_id!r} is swapped out, not running; "
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

    def _own(self, req: KVRequest) -> None:
        """``req`` is this manager's from now on: its hash chain is made with this manager's
        hasher, and it has an allocation in every group."""
        req.chain.claim(self)
        req.hold_groups(len(self.groups))

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
        slots = self.groups[0].slots
        return slots.num_free > 0 if slot is None else slots.is_free(slot)

    def _require_committed(self, req: KVRequest) -> None:
        if req.allocation.num_computed != req.allocation.num_tokens:
            raise RequestStateError(
                f"request {req.request_id!r} has {req.num_tokens - req.num_computed_tokens} reserved "
                "tokens not yet computed; commit() them first")

    def _refused(self, operation: str, req: KVRequest | str, slot: int | None, needs: list[int],
                 revived: "list[list[int]] | None" = None) -> None:
        """Record in ``last_refusal`` why ``operation`` was refused, the slot (``slot``, or any)
        or the fresh blocks (``needs[g]`` for group ``g``, beside the cached ``revived[g]``) not
        being there; returns None. Called only once the call is refused, so it costs the
        calls that succeed nothing."""
        if not self._slot_available(slot):
            self.last_refusal = Refusal(operation, req if isinstance(req, str) else req.request_id,
                                        "no_free_slot" if slot is None else "slot_taken", slot)
            return None
        return self._short_of_blocks(operation, req, slot, needs, revived)

    def _short_of_blocks(self, operation: str, req: KVRequest | str, slot: int | None, needs: list[int],
                         revived: "list[list[int]] | None" = None) -> None:
        """``_refused`` for a call refused by the blocks: the first pool short of them."""
        request_id = req if isinstance(req, str) else req.request_id
        counts = [(members, sum(needs[g] for g in members),
                   memory.available_besides([b for g in members for b in revived[g]] if revived else ()))
                  for memory, members in self._members]
        members, needed, available = next((count for count in counts if count[1] > count[2]), counts[0])
        group = None if len(self.groups) == 1 else " and ".join(
            f"the {self.groups[g].spec.describe()} layers" for g in members)
        self.last_refusal = Refusal(operation, request_id, "out_of_blocks", slot, needed, available, group)
        return None

    # --- the memories' blocks over every group ------------------------------------------------------
    def _fits(self, needs: list[int], revived: "list[list[int]] | None" = None) -> bool:
        """Whether every memory has the fresh blocks its groups need (``needs[g]`` for group
        ``g``) once the cached blocks of ``revived[g]`` (hits leaving the free queue) are not free."""
        for memory, members in self._members:
            needed = needs[members[0]] if len(members) == 1 else sum(needs[g] for g in members)
            if revived is None:
                if not memory.fits(needed):
                    return False
            elif not memory.fits(needed, [b for g in members for b in revived[g]]):
                return False
        return True

    def _peek(self, needs: list[int], exclude: "list[list[int]] | None" = None) -> list[list[int]]:
        """The fresh blocks each group's part of an operation takes (``needs[g]`` of them for
        group ``g``), as its memory will hand them out in one take after every group took its
        shared references (``exclude[g]``: cached hits those references take out of the queue)."""
        fresh: list[list[int]] = [[]] * len(needs)  # replaced, never appended to
        for memory, members in self._members:
            total = needs[members[0]] if len(members) == 1 else sum(needs[g] for g in members)
            if not total:
                continue
            kept = () if exclude is None else [b for g in members for b in exclude[g]]
            blocks = memory.pool.peek(total, exclude=kept)
            if len(members) == 1:
                fresh[members[0]] = blocks
                continue
            for g in members:
                fresh[g], blocks = blocks[:needs[g]], blocks[needs[g]:]
        return fresh

    def _take(self, fresh: list[list[int]]) -> None:
        """Take the blocks ``_peek`` planned, one call for each memory, in its groups' order."""
        for memory, members in self._members:
            planned = fresh[members[0]] if len(members) == 1 else [b for g in members for b in fresh[g]]
            if planned:
                memory.pool.take(planned)

    def _copy(self, copies: list[list[tuple[int, int]]]) -> None:
        """Make each group's block copies ``copies[g]`` (source, copy), one call for each memory."""
        for memory, members in self._members:
            pairs = copies[members[0]] if len(members) == 1 else [p for g in members for p in copies[g]]
            memory.copy_blocks(pairs)
        for group, group_copies in zip(self.groups, copies):
            group.blocks_copied += len(group_copies)

    # --- prefix hits over every group ------------------------------------------------------------
    def _common_hits(self, hashes: list[bytes], hits: list[list[int]], length: int) -> list[list[int]]:
        """Every group's ``hits`` of ``hashes`` cut to the longest prefix of at most ``length``
        blocks that every group can reuse (a windowed group's hit within a shorter prefix starts
        its window earlier, so it may be shorter again: repeated until they agree)."""
        groups = self.groups
        while True:
            hits = [group.capped_hits(hashes, group_hits, length) for group, group_hits in zip(groups, hits)]
            shortest = min(len(group_hits) for group_hits in hits)
            if all(len(group_hits) == shortest for group_hits in hits):
                return hits
            length = shortest

    def _cached_hits(self, hashes: list[bytes], num_tokens: int) -> list[list[int]]:
        """Each group's cached blocks of the longest prefix of ``hashes`` every group can reuse,
        leaving at least one of ``num_tokens`` tokens to compute."""
        hashes = hashes[: (num_tokens - 1) // self.tokens_per_page]
        hits, length = [], len(hashes)
        for group in self.groups:  # a later group looks only as far as the earlier ones hit
            hits.append(group.cached_blocks(hashes if length == len(hashes) else hashes[:length]))
            length = min(length, len(hits[-1]))
        if all(len(group_hits) == length for group_hits in hits):
            return hits
        return self._common_hits(hashes, hits, length)

    def _prefix_hits(self, req: KVRequest) -> list[list[int]]:
        """``req``'s cached prefix blocks in every group, hashing only blocks its chain does not
        cover yet."""
        if not self.config.enable_prefix_caching:
            return [[] for _ in self.groups]
        num_tokens = len(req.token_ids)
        return self._cached_hits(self._extend_chain(req, (num_tokens - 1) // self.tokens_per_page),
                                 num_tokens)

    def _host_reach(self, req: KVRequest, hits: list[list[int]], num_new_tokens: int | None,
                    token_budget: int | None, max_blocks: int | None) -> int:
        """How many prompt blocks an admission reuses: the device ``hits`` (one length in every
        group), extended by the blocks every group's host tier holds after them, as many as
        every group's free blocks take (each is copied into a fresh block; under a token budget,
        chunked prefill, a shorter hit may need fewer blocks now). No side effect."""
        groups, device = self.groups, len(hits[0])
        if not all(group.host_tier.capacity for group in groups):
            return device
        tokens_per_page, num_prompt = self.tokens_per_page, len(req.token_ids)
        end = (num_prompt - 1) // tokens_per_page
        if max_blocks is not None:
            end = min(end, max_blocks)
        candidates = req.chain.hashes[device:end]
        run = min(group.host_run(candidates) for group in groups)
        for keep in range(run, 0, -1):
            cached = (device + keep) * tokens_per_page
            new = num_prompt - cached if num_new_tokens is None else num_new_tokens
            if token_budget is not None:
                new = min(new, token_budget)
            if self._fits([group.admit_needs(group_hits, cached + new) for group, group_hits in zip(groups, hits)],
                          hits):
                return device + keep
        return device

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

    def _register_full(self, req: KVRequest, full: int) -> None:
        """Offer the request's full blocks up to ``full`` (tokens checked) to every group's
        prefix cache."""
        hashes = self._extend_chain(req, full)
        root = self._chain_root(req.keys) if not req.allocation.num_registered else None
        for group, alloc in zip(self.groups, req.allocations):
            group.register_full(alloc, full, req.token_ids, hashes, root)
