"""KV cache for models that mix sliding-window (local) and full-attention (global) layers
(Gemma-2/3, GPT-OSS, Cohere2): one layout group per attention kind.

Each group is a :class:`KVCacheManager` over its own layers: its own virtual tensors (slot
reservations), its own pool, hash chain and page accounting. The local group has
``CacheConfig.sliding_window`` set, so its blocks wholly behind the window go back to its pool
while the request runs (``manager_state._release_behind_window``, unchanged); the global group
keeps every block. A request is the caller's :class:`KVRequest` in the global group and a shadow
``KVRequest`` sharing the same token list in the local group; both are bound to the same slot
index, so attention addresses a layer's K/V by ``req.slot`` whichever group holds it.

Operations ask both groups whether they fit (``_fits_admission``, ``can_allocate``,
``_revivals_if_it_fits`` for a swap-in, free slots and blocks for a fork, swap room), and whether
the process's mapping budget takes both groups' new mappings (``hybrid_budget.check_budget``),
before changing either: a refused operation changes neither group. (The budget is asked, not
reserved: another manager in the process mapping between the check and the second group's
change, or a CUDA map failing, which has no budget to ask, would leave the groups apart; the
engine's steps do not overlap its own mapping.) Admission caps both
groups' prefix hits to the length both can reuse (the global group's full prefix, the local
group's window of it: ``ManagerState._capped_hits``), extended by host-tier hits only as far as
both groups' host tiers continue it (each group has its own ``HostTier`` over its own host block
store, the host bytes split by layers: ``layer_groups.group_configs``).

Why two managers and two pools rather than groups inside one manager: every operation of the
one-group manager (plan, check, apply; release; prefix hits; swap; the invariant check) is
reused unchanged, so single-group models keep today's path and speed, and the local group's
demand is bounded (slots x window, plus one step's chunk), so a static split of the bytes
(``layer_groups.split_blocks``) costs little. The price: the split is a guess where chunks are
large, and each group's pages hold whole tokens of fewer layers, so they may hold more tokens
than the whole model's would (prefix hits and growth in coarser steps).

The module is over 400 lines because the class mirrors the whole ``KVCacheManager`` API (admit
to reorder and truncate), each method a short plan-check-apply over both groups: each group
plans once (``plans.py``), ``hybrid_budget`` checks both plans, each group executes its plan;
the lookahead lives in ``hybrid_lookahead``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from . import validation as check
from .cache_config import CacheConfig, CacheStats, PreemptionEstimate
from .errors import ConfigError, InvalidInputError, MappingLimitError, RequestStateError
from .hybrid_budget import check_budget, planned, reorder_plan, truncate_plan
from .hybrid_lookahead import HybridLookaheadOps
from .kv_events import KVEventSink, group_sink
from .kv_metrics import KVMetricsCollector
from .layer_groups import LayerGroups, group_configs
from .manager import KVCacheManager, PrefixCacheBusyError
from .plans import reorder_copies
from .request import RELEASED, KVRequest


def hybrid_manager(config: CacheConfig, layer_windows: Sequence[int | None] | None,
                   chunk_tokens: int | None = None, metrics: KVMetricsCollector | None = None,
                   events: KVEventSink | None = None,
                   backends: "Callable[[CacheConfig], object] | None" = None) -> "HybridKVCacheManager | None":
    """A :class:`HybridKVCacheManager` for a model whose layers mix kinds (``layer_windows``
    from ``hf_support.hybrid_layer_windows``), or None when they do not, or when its groups'
    pages cannot hold one number of tokens (the caller then keeps every block in one group).
    ``backends``: makes each group's backend from the group's config (global, then local), as
    tensor parallelism records them; default: each group makes its own."""
    if not layer_windows:
        return None
    try:
        configs = group_configs(config, LayerGroups.from_windows(layer_windows), chunk_tokens)
    except ConfigError:
        return None
    return HybridKVCacheManager(config, layer_windows, chunk_tokens, metrics=metrics, events=events,
                                backends=None if backends is None else [backends(group) for group in configs])


def _group_reach(group: KVCacheManager, req: KVRequest, max_blocks: int, num_new_tokens: int | None,
                 token_budget: int | None) -> int:
    """How many prompt blocks ``group.admit(req, ..., max_cached_tokens=max_blocks *
    tokens_per_page)`` reuses, by the same steps, changing nothing: its device hits and the
    host tier's hits after them (as many as fit)."""
    hits = group._capped_hits(req, group._prefix_hits(req), max_blocks)
    host = group._host_hits(req, hits, num_new_tokens, token_budget)
    return len(hits) + min(len(host), max(0, max_blocks - len(hits)))


class GroupReads:
    """``SlotReads`` over every group: a batch of consecutive slots is read in one call only
    when each group can make its rows readable (a group that could keeps its filler pinned
    until ``release_reads``, harmlessly)."""

    def __init__(self, groups: list, num_layers: int):
        self.groups, self.num_layers = groups, num_layers

    def make_readable(self, slots: list[int], num_tokens: int) -> bool:
        return all([group.make_readable(slots, num_tokens) for group in self.groups])

    def release_reads(self) -> None:
        for group in self.groups:
            group.release_reads()


class HybridKVCacheManager(HybridLookaheadOps):
    """``HybridKVCacheManager(config, layer_windows, chunk_tokens=None, local_blocks=None,
    metrics=None, events=None, backends=None)``: ``config`` describes the whole model (``num_layers`` all layers,
    ``num_blocks`` blocks of all layers, shared as ``layer_groups.split_blocks`` says);
    ``layer_windows`` each layer's window (None: global); ``backends``: the (global, local)
    groups' backends, sized for ``layer_groups.group_configs`` (tensor parallelism records them);
    ``events``, a KV event sink told both groups' blocks, each event tagged with its group
    (``kv_events.group_sink``: ``group_idx`` 0 for the global group, 1 for the local one).

    It answers what the engine asks of a ``KVCacheManager`` (admit, allocate, commit, free,
    fork, preempt by swap or recompute, swap in, the views and the queries). Block counts
    (``num_blocks``, ``num_free_blocks``, ``blocks_for_tokens``, ...) are the global group's,
    the one that grows with a request; the local group is sized for its peak, and every
    operation also checks it. Beam search (``reorder``) and cropping (``truncate``) change both
    groups or neither. Lookahead (the engine's overlapped mapping) gives a decoding request its
    next blocks in both groups or in neither (``allocate_lookahead``). Both groups hash with one
    seed, so a block's content has one hash in either group, and each group's pool (and host
    tier) tells ``events`` its own blocks (``group_idx``). With ``host_cache_bytes``, each group
    demotes its evicted blocks to its own host tier, and an admission promotes a host hit only
    where both groups' tiers hold it (``_admission_blocks``). ``layout_groups`` lists the groups'
    managers, (global, local), as ``KVCacheManager.layout_groups`` lists itself; ``layer_group``
    names the one holding a model layer."""

    def __init__(self, config: CacheConfig, layer_windows: Sequence[int | None],
                 chunk_tokens: int | None = None, local_blocks: int | None = None,
                 metrics: KVMetricsCollector | None = None, backends: Sequence | None = None,
                 events: KVEventSink | None = None):
        if len(layer_windows) != config.num_layers:
            raise ConfigError(f"layer_windows has {len(layer_windows)} entries for "
                              f"{config.num_layers} layers")
        if config.sliding_window or config.attention_chunk_size:
            raise ConfigError("a hybrid config gives windows or chunks per layer (layer_windows), not "
                              "CacheConfig.sliding_window or attention_chunk_size")
        self.groups = LayerGroups.from_windows(layer_windows)
        # backends: (global, local), as group_configs; each group's pool (and host tier) tells the
        # events sink its blocks, tagged with the group
        self.global_group, self.local_group = (
            KVCacheManager(group, metrics=metrics, backend=backend,
                           events=group_sink(events, index, group.sliding_window,
                                             chunked=bool(group.attention_chunk_size)))
            for index, (group, backend) in enumerate(zip(
                group_configs(config, self.groups, chunk_tokens, local_blocks), backends or (None, None))))
        self.config = config
        self.tokens_per_page = self.global_group.tokens_per_page
        self._where = {}  # model layer -> (group manager, layer inside it)
        for manager, layers in ((self.global_group, self.groups.global_layers),
                                (self.local_group, self.groups.local_layers)):
            for index, layer in enumerate(layers):
                self._where[layer] = (manager, index)
        self.layout_groups = (self.global_group, self.local_group)  # as KVCacheManager.layout_groups
        self._local: dict[str, KVRequest] = {}  # admitted (running or swapped) id -> its local twin

    # --- the two requests of one ------------------------------------------------------------------
    def _pair(self, request: "KVRequest | str") -> tuple[KVRequest, KVRequest]:
        """The global group's request (the caller's) and the local group's."""
        req = self.global_group._known(request)
        return req, self._local[req.request_id]

    def _twin(self, req: KVRequest) -> KVRequest:
        """A new local-group request for ``req``, stored nowhere (``admit`` and ``fork`` store a
        twin once both groups took it): it shares ``req``'s token list and starts from its hash
        chain, which is the local group's too (both groups hash with one seed into pages of one
        number of tokens), so a waiting request retried every step is hashed once. Binds both to
        their groups, as ``KVCacheManager.match_prefix`` binds a request."""
        self.global_group._check_open()
        if not isinstance(req, KVRequest):
            raise InvalidInputError(f"request is a {type(req).__name__} ({req!r:.40}); a hybrid "
                                    "manager admits a vmemkv.KVRequest")
        self.global_group._check_not_foreign(req)
        req.chain.claim(self.global_group)
        if self.config.enable_prefix_caching:  # the chain _prefix_hits reads, hashed here once
            self.global_group._extend_chain(req, (len(req.token_ids) - 1) // self.tokens_per_page)
        local = KVRequest(req.request_id, req.token_ids, req.keys)
        local.chain.copy_from(req.chain)
        local.chain.claim(self.local_group)
        return local

    def _claim(self, req: KVRequest) -> KVRequest:
        """``_twin`` for an admission: RequestStateError, before anything, for an id already
        admitted (running or swapped), whichever object carries it."""
        if isinstance(req, KVRequest) and req.request_id in self.global_group._requests:
            raise RequestStateError(f"request {req.request_id!r} is already admitted")
        return self._twin(req)

    def _hits(self, req: KVRequest, local: KVRequest) -> tuple[list[int], list[int]]:
        """Both groups' prefix hits, cut to one length both can reuse: the global group's full
        prefix and the local group's window of it."""
        global_hits = self.global_group._prefix_hits(req)
        local_hits = self.local_group._prefix_hits(local)
        local_hits = self.local_group._capped_hits(local, local_hits, len(global_hits))
        return global_hits[:len(local_hits)], local_hits

    def _admission_blocks(self, req: KVRequest, local: KVRequest, num_new_tokens: int | None,
                          token_budget: int | None, max_cached_tokens: int | None = None) -> int:
        """The blocks of the prompt both groups reuse (at most ``max_cached_tokens``' worth): the
        device hits both hold (``_hits``), extended as far as both groups' host tiers continue
        the prefix and both admissions would promote (``_group_reach``), so an admission
        promotes only what both groups can."""
        _, local_hits = self._hits(req, local)
        most = (len(req.token_ids) - 1 if max_cached_tokens is None else max_cached_tokens) // self.tokens_per_page
        device = len(self.local_group._capped_hits(local, local_hits, most))
        if self.global_group.host_tier.capacity and self.local_group.host_tier.capacity:
            blocks = most
            while blocks > device:  # shrinks to the longest length both reach
                global_count, local_count = (
                    _group_reach(group, request, blocks, num_new_tokens, token_budget)
                    for group, request in ((self.global_group, req), (self.local_group, local)))
                if global_count == local_count == blocks:
                    return blocks
                blocks = min(global_count, local_count)
        return device

    # --- admission and growth ---------------------------------------------------------------------
    def match_prefix(self, req: KVRequest) -> tuple[list[int], list[bytes]]:
        """The global group's cached blocks of the prefix both groups can reuse, and its hashes."""
        global_hits, _ = self._hits(req, self._twin(req))
        return global_hits, list(req.block_hashes)

    def can_admit(self, req: KVRequest) -> bool:
        global_hits, local_hits = self._hits(req, self._twin(req))
        total = len(req.token_ids)
        return (self.num_free_slots > 0 and self.global_group._fits_admission(global_hits, total)
                and self.local_group._fits_admission(local_hits, total))

    def admit(self, req: KVRequest, num_new_tokens: int | None = None,
              token_budget: int | None = None, slot: int | None = None,
              max_cached_tokens: int | None = None) -> int | None:
        """``KVCacheManager.admit`` in both groups, into one slot (``slot`` when given), its
        prefix hit capped at ``max_cached_tokens``; None, changing nothing, when either group has
        no room or ``slot`` is taken (MappingLimitError, changing nothing, when the mapping budget
        does not take both)."""
        self.global_group._check_open()
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens", optional=True)
        token_budget = check.count(token_budget, "token_budget", optional=True)
        limit = check.count(max_cached_tokens, "max_cached_tokens", optional=True)
        slot = check.slot_index(slot, self.num_slots)
        local = self._claim(req)  # after the arguments: a refused call binds nothing
        cached = self._admission_blocks(req, local, num_new_tokens, token_budget, limit) * self.tokens_per_page
        admissions = [group._admission(request, num_new_tokens, token_budget, cached)
                      for group, request in ((self.global_group, req), (self.local_group, local))]
        if any(admission.cached != cached for admission in admissions):
            raise AssertionError("the groups' admissions reuse prefixes of different lengths")
        free = self.num_free_slots if slot is None else self.global_group.is_slot_free(slot)
        if not (free and all(group._fits_admission(admission.hits, admission.num_tokens)
                             for group, admission in zip(self.layout_groups, admissions))):
            return None
        global_admission, local_admission = admissions
        global_plan = self.global_group._plan_admit(global_admission.hits, global_admission.num_tokens, slot)
        local_plan = self.local_group._plan_admit(local_admission.hits, local_admission.num_tokens,
                                                  global_plan.slot)
        check_budget([planned(self.global_group, global_plan), planned(self.local_group, local_plan)],
                     "admit")
        self.global_group._execute_admit(req, global_admission, global_plan)
        self.local_group._execute_admit(local, local_admission, local_plan)
        self._local[req.request_id] = local
        return cached

    def can_allocate(self, request: "KVRequest | str", num_new_tokens: int) -> bool:
        req, local = self._pair(request)
        return (self.global_group.can_allocate(req, num_new_tokens)
                and self.local_group.can_allocate(local, num_new_tokens))

    def blocks_needed(self, request: "KVRequest | str", num_new_tokens: int) -> int:
        req, _ = self._pair(request)
        return self.global_group.blocks_needed(req, num_new_tokens)

    def allocate(self, request: "KVRequest | str", num_new_tokens: int,
                 new_token_ids: Sequence[int] | None = None) -> bool:
        """Reserve ``num_new_tokens`` more positions in both groups (appending ``new_token_ids``
        once: both groups read the one list); False, changing nothing, when either lacks blocks."""
        req, local = self._pair(request)
        req = self.global_group._running(req)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        new_token_ids = () if new_token_ids is None else self.global_group._token_ids(new_token_ids,
                                                                                      "new_token_ids")
        self.global_group._check_length(req.request_id, req.num_tokens + num_new_tokens)
        if not self.can_allocate(req, num_new_tokens):
            return False
        plans = [group._plan_grow(request, num_new_tokens)
                 for group, request in ((self.global_group, req), (self.local_group, local))]
        check_budget([planned(group, plan) for group, plan in zip(self.layout_groups, plans)], "allocate")
        self.global_group._execute_grow(req, plans[0], num_new_tokens, new_token_ids)
        self.local_group._execute_grow(local, plans[1], num_new_tokens)  # the tokens are appended
        return True

    def allocate_each(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> int:
        """``allocate(requests[i], counts[i])`` in order until one is refused (each in both
        groups or neither); returns how many got their positions. Bad input raises before any
        change (``KVCacheManager.allocate_each``)."""
        if len(requests) != len(counts):
            raise InvalidInputError(f"{len(requests)} requests but {len(counts)} counts")
        reqs = [self.global_group._running(self._pair(request)[0]) for request in requests]
        counts = [check.count(count, "num_new_tokens") for count in counts]
        for req, count in zip(reqs, counts):
            self.global_group._check_length(req.request_id, req.num_tokens + count)
        for done, (req, count) in enumerate(zip(reqs, counts)):
            try:
                if not self.allocate(req, count):
                    return done
            except MappingLimitError:  # refused by the mapping budget, nothing changed
                return done
        return len(reqs)

    def commit(self, request: "KVRequest | str", num_computed_tokens: int | None = None) -> None:
        """Commit both groups; the local group gives back its blocks behind the window."""
        self._commit_pairs([self._pair(request)], num_computed_tokens)

    def commit_all(self, requests: "Sequence[KVRequest | str]") -> None:
        """``commit(request)`` for each request, every one checked in both groups first."""
        self._commit_pairs([self._pair(request) for request in requests], None)

    def _commit_pairs(self, pairs: list[tuple[KVRequest, KVRequest]], done: int | None) -> None:
        """Check every request's commit in both groups, then commit them (a refusal, raised,
        changes neither group)."""
        if done is not None:
            done = check.count(done, "num_computed_tokens")
        for req, local in pairs:
            for group, request in ((self.global_group, req), (self.local_group, local)):
                group._check_commit(group._running(request), request.num_tokens if done is None else done)
        for req, local in pairs:
            self.global_group.commit(req, done)
            self.local_group.commit(local, done)

    # --- freeing, sharing, preemption -------------------------------------------------------------
    def free(self, request: "KVRequest | str") -> None:
        req, local = self._pair(request)
        self.global_group.free(req)
        self.local_group.free(local)
        del self._local[req.request_id]

    def discard(self, request: "KVRequest | str") -> None:
        """``KVCacheManager.discard`` in both groups: the local twin goes only with the request
        the global group freed (another KVRequest object with a running request's id frees
        neither); an id that is not admitted is forgotten by both (its recompute preemption)."""
        request_id = request.request_id if isinstance(request, KVRequest) else check.request_id(request)
        held = self.global_group._requests.get(request_id)
        freed = held is not None and (held is request or not isinstance(request, KVRequest))
        self.global_group.discard(request)  # refuses a foreign request before any change
        if freed:
            self.local_group.discard(self._local.pop(request_id))
        elif held is None:
            self.local_group.discard(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget both groups' cached content (and host tiers). PrefixCacheBusyError, changing
        nothing, while either group holds blocks. Returns the global group's cached blocks
        dropped (block counts are the global group's)."""
        for name, group in (("global", self.global_group), ("local", self.local_group)):
            group._check_open()
            if group.pool.num_in_use:
                raise PrefixCacheBusyError(
                    f"cannot reset the prefix cache: the {name} layers' group has "
                    f"{group.pool.num_in_use} blocks held by {len(group.request_ids())} request(s); "
                    "free or finish them first")
        dropped = self.global_group.reset_prefix_cache()
        self.local_group.reset_prefix_cache()
        return dropped

    def fork(self, parent: "KVRequest | str", child: "KVRequest | str",
             slot: int | None = None) -> KVRequest | None:
        """``KVCacheManager.fork`` in both groups, into one slot (``slot`` when given); None,
        changing nothing, without a slot (or not ``slot``) or a block in either group
        (MappingLimitError, changing nothing, when the mapping budget does not take both)."""
        parent, local_parent = self._pair(parent)
        parent = self.global_group._running(parent)
        slot = check.slot_index(slot, self.num_slots)
        child_id = self.global_group._fork_child_id(parent, child)
        self.local_group._fork_child_id(local_parent, child_id)
        partial = parent.num_tokens % self.tokens_per_page != 0
        free = self.num_free_slots if slot is None else self.global_group.is_slot_free(slot)
        if not free or (partial and not (self.global_group.num_free_blocks
                                         and self.local_group.num_free_blocks)):
            return None
        global_plan = self.global_group._plan_fork(parent, slot)
        local_plan = self.local_group._plan_fork(local_parent, global_plan.slot)
        check_budget([planned(self.global_group, global_plan), planned(self.local_group, local_plan)],
                     "fork")
        child = self.global_group._execute_fork(parent, child, child_id, global_plan)
        self._local[child_id] = self.local_group._execute_fork(
            local_parent, KVRequest(child_id, child.token_ids, child.keys), child_id, local_plan)
        return child

    def estimate_preemption(self, request: "KVRequest | str") -> PreemptionEstimate:
        """Both groups' costs together (recompute: the global group's tokens, which are the
        same computation)."""
        req, local = self._pair(request)
        both = self.global_group.estimate_preemption(req), self.local_group.estimate_preemption(local)
        swap_bytes = both[0].swap_bytes + both[1].swap_bytes
        return dataclasses.replace(both[0], swap_bytes=swap_bytes,
                                   swap_seconds=both[0].swap_seconds + both[1].swap_seconds,
                                   swap_fits=both[0].swap_fits and both[1].swap_fits)

    def preempt(self, request: "KVRequest | str", mode: str = "auto") -> str:
        """Preempt in both groups the same way (``auto``: by the estimate of both)."""
        req, local = self._pair(request)
        if mode == "auto":
            mode = self.estimate_preemption(req).cheaper
        if mode == "swap":  # refuse before either group changes
            self.global_group.swap.check_room(self._private_blocks(self.global_group, req))
            self.local_group.swap.check_room(self._private_blocks(self.local_group, local))
        self.global_group.preempt(req, mode)
        self.local_group.preempt(local, mode)
        if mode == "recompute":  # holds nothing now; its next admission makes a new twin
            del self._local[req.request_id]
        return mode

    @staticmethod
    def _private_blocks(manager: KVCacheManager, req: KVRequest) -> int:
        return sum(b != RELEASED and manager.pool.ref[b] == 1 for b in manager._reserved_blocks(req))

    def swap_in(self, request: "KVRequest | str") -> bool:
        """Both groups back, into one slot; False, changing nothing, when either has no room."""
        req, local = self._pair(request)
        req = self.global_group._swapped_request(req)
        global_revive = self.global_group._revivals_if_it_fits(req, None)
        if global_revive is None:
            return False
        global_plan = self.global_group._plan_swap_in(req, None, global_revive)
        local_revive = self.local_group._revivals_if_it_fits(local, global_plan.slot)
        if local_revive is None:
            return False
        local_plan = self.local_group._plan_swap_in(local, global_plan.slot, local_revive)
        check_budget([planned(self.global_group, global_plan), planned(self.local_group, local_plan)],
                     "swap in")
        self.global_group._execute_swap_in(req, global_plan, global_revive)
        self.local_group._execute_swap_in(local, local_plan, local_revive)
        return True

    def is_swapped(self, request: "KVRequest | str") -> bool:
        return self.global_group.is_swapped(request)

    # --- what attention and the engine read -------------------------------------------------------
    def layer_group(self, layer: int) -> KVCacheManager:
        """The manager of the layout group holding model layer ``layer`` (its window is the
        layer's: None for a global layer)."""
        return self._where[check.layer_index(layer, self.config.num_layers)][0]

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``layer``'s K and V over every slot, from its group's virtual tensors."""
        manager, index = self._where[check.layer_index(layer, self.config.num_layers)]
        return manager.kv_views(index)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        manager, index = self._where[check.layer_index(layer, self.config.num_layers)]
        return manager.block_views(index)

    def batched_reads(self) -> "GroupReads":
        """Batched CPU reads over both groups' slots (``attention.contiguous.SlotReads``)."""
        return GroupReads([self.global_group.batched_reads(), self.local_group.batched_reads()],
                          self.config.num_layers)

    def block_table(self, request: "KVRequest | str", layer: int) -> list[int]:
        """The blocks of ``request`` in layer ``layer``'s group (RELEASED behind a window)."""
        req, local = self._pair(request)
        manager, _ = self._where[check.layer_index(layer, self.config.num_layers)]
        return manager.block_table(req if manager is self.global_group else local)

    def local_request(self, request: "KVRequest | str") -> KVRequest:
        """The local group's request of ``request`` (its block table, released count)."""
        return self._pair(request)[1]

    def request(self, request_id: str) -> KVRequest:
        return self.global_group.request(request_id)

    def request_ids(self) -> list[str]:
        return self.global_group.request_ids()

    # Per-request counts: the same in both groups (``check``), so the global group's.
    def slot_of(self, request: "KVRequest | str") -> int:
        return self.global_group.slot_of(request)

    def num_tokens(self, request: "KVRequest | str") -> int:
        return self.global_group.num_tokens(request)

    def num_computed_tokens(self, request: "KVRequest | str") -> int:
        return self.global_group.num_computed_tokens(request)

    def token_ids(self, request: "KVRequest | str") -> list[int]:
        return self.global_group.token_ids(request)

    def can_swap_in(self, request: "KVRequest | str") -> bool:
        """Whether ``swap_in`` would find a slot and both groups' blocks now."""
        req, local = self._pair(request)
        return (self.global_group.can_swap_in(req)
                and self.local_group.can_swap_in(local, self.global_group.slots.choose()))

    # --- sizes and accounting (the global group's blocks; see the class docstring) ---------------
    @property
    def layout(self):
        """The global group's layout (the dtype and head shapes every layer shares)."""
        return self.global_group.layout

    @property
    def num_free_slots(self) -> int:
        return self.global_group.num_free_slots

    @property
    def num_slots(self) -> int:
        return self.global_group.num_slots

    num_blocks = property(lambda self: self.global_group.num_blocks)
    num_free_blocks = property(lambda self: self.global_group.num_free_blocks)
    num_blocks_in_use = property(lambda self: self.global_group.num_blocks_in_use)
    num_cached_blocks = property(lambda self: self.global_group.num_cached_blocks)
    block_bytes = property(lambda self: self.global_group.block_bytes)

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks held by requests, in both groups."""
        return self.global_group.kv_bytes_in_use + self.local_group.kv_bytes_in_use

    def usage(self) -> float:
        return max(self.global_group.usage(), self.local_group.usage())

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        return self.global_group.blocks_for_tokens(num_tokens, chunk_tokens)

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None:
        return (self.global_group.why_never_fits(num_tokens, chunk_tokens)
                or self.local_group.why_never_fits(num_tokens, chunk_tokens))

    def can_ever_fit(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        return self.why_never_fits(num_tokens, chunk_tokens) is None

    def cache_stats(self) -> CacheStats:
        """The global group's counters (prefix hits are the same length in both; host-tier
        block counts are the global group's), with the local group's blocks released behind the
        window, and the bytes both groups copied to and from the host."""
        stats, local = self.global_group.cache_stats(), self.local_group.cache_stats()
        stats.blocks_released_behind_window = local.blocks_released_behind_window
        for name in ("swap_out_bytes", "swap_in_bytes", "host_bytes_demoted", "host_bytes_promoted"):
            setattr(stats, name, getattr(stats, name) + getattr(local, name))
        return stats

    def snapshot_stats(self) -> dict:
        """The global group's snapshot with the local group's block counts beside it
        (``local_blocks_*``) and ``kv_bytes_in_use`` over both."""
        out = {**self.global_group.snapshot_stats(), **dataclasses.asdict(self.cache_stats())}
        local = self.local_group.snapshot_stats()
        for key in ("blocks_total", "blocks_in_use", "blocks_cached", "blocks_clean",
                    "host_blocks_cached", "host_blocks_total"):
            out[f"local_{key}"] = local[key]
        out["kv_bytes_in_use"] = self.kv_bytes_in_use
        return out

    def check(self) -> None:
        """Both groups' invariants, and that each request is in step across them."""
        self.global_group.check()
        self.local_group.check()
        assert self.global_group.request_ids() == self.local_group.request_ids(), "groups hold different requests"
        assert set(self._local) == set(self.global_group.request_ids()), (
            f"local twins of requests not admitted: {sorted(set(self._local) - set(self.global_group.request_ids()))}")
        for request_id in self.global_group.request_ids():
            req, local = self.global_group.request(request_id), self._local[request_id]
            assert self.local_group.request(request_id) is local
            assert req.slot == local.slot, f"{request_id}: slots {req.slot} and {local.slot}"
            assert req.is_swapped == local.is_swapped
            assert (req.num_tokens, req.num_computed_tokens) == (local.num_tokens, local.num_computed_tokens)
            assert len(req.allocation.blocks) == len(local.allocation.blocks), (
                f"{request_id}: lookahead in one group only")
            assert req.token_ids is local.token_ids
            common = min(len(req.chain.hashes), len(local.chain.hashes))
            assert req.chain.hashes[:common] == local.chain.hashes[:common], f"{request_id}: hash chains differ"

    def close(self) -> None:
        self.global_group.close()
        self.local_group.close()

    def is_slot_free(self, slot: int) -> bool:
        return self.global_group.is_slot_free(slot)

    def free_slots(self) -> list[int]:
        return self.global_group.free_slots()

    # --- beam search and cropping, in both groups ------------------------------------------------
    def reorder(self, requests: "Sequence[KVRequest | str]", sources: "Sequence[KVRequest | str]") -> bool:
        """``KVCacheManager.reorder`` in both groups: row ``requests[i]`` becomes a copy of
        ``sources[i]`` (each row keeps its window: pages behind its source's window stay
        released). False, changing nothing, when either group lacks blocks for the copied
        partial blocks (MappingLimitError, changing nothing, when the mapping budget does not
        take both)."""
        rows, sources = self.global_group._check_reorder_rows(requests, sources)
        local_rows = [self._local[row.request_id] for row in rows]
        local_sources = [self._local[source.request_id] for source in sources]
        copied = reorder_copies(self.tokens_per_page, rows, sources)
        if sum(copied) > min(self.global_group.num_free_blocks, self.local_group.num_free_blocks):
            return False
        check_budget([reorder_plan(self.global_group, rows, sources, copied),
                      reorder_plan(self.local_group, local_rows, local_sources, copied)], "reorder")
        contents = [list(source.token_ids) for source in sources]
        if not (self.global_group.reorder(rows, sources)
                and self.local_group.reorder(local_rows, local_sources)):
            raise AssertionError("a group refused a reorder both said fits")
        # Each group copied its sources' token lists into its rows' lists, which both groups
        # share: the second group read lists the first had already rewritten.
        for row, tokens in zip(rows, contents):
            row.token_ids[:] = tokens
        return True

    def truncate(self, request: "KVRequest | str", num_tokens: int) -> bool:
        """``KVCacheManager.truncate`` in both groups: forget positions from ``num_tokens`` on.
        RequestStateError, changing nothing, when the local layers' query at ``num_tokens``
        would read positions already released behind their window; False, changing nothing,
        when a group needs a block to copy a shared last block into and has none
        (MappingLimitError, changing nothing, when the mapping budget does not take both)."""
        req, local = self._pair(request)
        num_tokens = self._check_truncate(req, local, num_tokens)
        plans = [truncate_plan(self.global_group, req, num_tokens),
                 truncate_plan(self.local_group, local, num_tokens)]
        if None in plans:
            return False
        check_budget(plans, "truncate")
        if not (self.global_group.truncate(req, num_tokens) and self.local_group.truncate(local, num_tokens)):
            raise AssertionError("a group refused a truncation both said fits")
        return True

    def _check_truncate(self, req: KVRequest, local: KVRequest, num_tokens: int) -> int:
        """``num_tokens`` checked for truncating ``req`` (and its twin ``local``) in both groups
        (``SharingOps._check_truncate``: the local layers' window is the one that can refuse)."""
        num_tokens = self.global_group._check_truncate(req, num_tokens)
        return self.local_group._check_truncate(local, num_tokens, "local layers' ")

    def can_truncate(self, requests: "Sequence[KVRequest | str]", num_tokens: int) -> bool:
        """``KVCacheManager.can_truncate`` in both groups: whether truncating every one of
        ``requests`` to ``num_tokens``, one after another, finds each group's copies a free block
        (each request checked as ``truncate`` checks it). Changes nothing."""
        pairs = list({id(pair[0]): pair for pair in map(self._pair, requests)}.values())  # once each
        for req, local in pairs:
            num_tokens = self._check_truncate(req, local, num_tokens)
        return all(group._truncations_fit([pair[index] for pair in pairs], num_tokens)
                   for index, group in enumerate(self.layout_groups))
