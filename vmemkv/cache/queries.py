"""What the KV cache manager tells without changing anything: the queries a scheduler asks
(``can_admit``, ``match_prefix``, ``blocks_needed``, ``why_never_fits``), the sizes and counts an
engine or adapter reads instead of the parts, the K/V views attention reads, a request's
allocation by id, and the stats. Part of :class:`vmemkv.KVCacheManager` (``manager.py`` has its
construction and the operations that change the cache).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from vmemkv import validation as check
from vmemkv.cache.config import CacheStats
from vmemkv.cache.group import KVCacheGroup
from vmemkv.cache.hashing import CacheKeys
from vmemkv.cache.manager_state import ManagerState
from vmemkv.cache.metrics import timed
from vmemkv.cache.request import KVRequest
from vmemkv.errors import InvalidInputError

class GroupReads:
    """``SlotReads`` over every layer group: a batch of consecutive slots is read in one call
    only when each group can make its rows readable (a group that could keeps its filler
    pinned until ``release_reads``, harmlessly)."""

    def __init__(self, groups: list, num_layers: int):
        self.groups, self.num_layers = groups, num_layers

    def make_readable(self, slots: list[int], num_tokens: int) -> bool:
        return all([group.make_readable(slots, num_tokens) for group in self.groups])

    def release_reads(self) -> None:
        for group in self.groups:
            group.release_reads()



class PoolUsage(NamedTuple):
    """One pool's blocks (``KVCacheManager.pool_usage``; the pools in ``memories`` order)."""

    blocks_in_use: int  # held by requests
    blocks_free: int  # clean and cached ones
    blocks_copied: int  # copy-on-write copies its layer groups have made so far
    block_bytes: int


class KVCacheViews:
    """What a step's addressing and attention read of a manager (``KVViews``): the layout, the
    layer groups and the views over the pools, and nothing that changes the cache
    (``KVCacheManager.views()``)."""

    def __init__(self, manager: "ManagerQueries"):
        self._manager = manager
        # the manager's own bound methods: attention calls kv_views once per layer per step
        self.layer_group, self.kv_views = manager.layer_group, manager.kv_views
        self.block_views, self.batched_reads = manager.block_views, manager.batched_reads

    config = property(lambda self: self._manager.config)
    layout = property(lambda self: self._manager.layout)
    tokens_per_page = property(lambda self: self._manager.tokens_per_page)
    layout_groups = property(lambda self: self._manager.layout_groups)


class ManagerQueries(ManagerState):
    """The read-only part of KVCacheManager (mixed into it)."""

    # --- queries without side effects ----------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        self._check_open()
        return self.groups[0].slots.num_free

    @timed
    def usage(self) -> float:
        """Fraction of blocks held by requests (of the fullest pool)."""
        self._check_open()
        return max(memory.pool.num_in_use / memory.pool.num_blocks for memory in self.memories)

    @timed
    def match_prefix(self, token_ids: "Sequence[int] | KVRequest",
                     keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of ``token_ids`` (whole blocks, leaving at least one
        token to compute) and the hashes of all full blocks of ``token_ids``. With a sliding
        window, the longest prefix whose blocks its next query's window reads are cached, with
        ``RELEASED`` (-1) for the blocks before that window (they need not be cached); with
        several layer groups, the first group's blocks of the longest prefix every group can
        reuse. Given a KVRequest, its own tokens and keys, and its hash chain (extended, never
        recomputed)."""
        self._check_open()
        if not self.config.enable_prefix_caching:
            return [], []
        if isinstance(token_ids, KVRequest):
            req = token_ids
            self._check_not_foreign(req)
            self._own(req)  # its hash chain is this manager's from now on
            hashes = list(self._extend_chain(req, len(req.token_ids) // self.tokens_per_page))
            return self._cached_hits(hashes, len(req.token_ids))[0], hashes
        token_ids = self._token_ids(token_ids, "token_ids")
        hashes = self.hasher.block_hashes(token_ids, self.tokens_per_page, check.cache_keys(keys))
        return self._cached_hits(hashes, len(token_ids))[0], hashes

    @timed
    def can_admit(self, token_ids: "Sequence[int] | KVRequest", keys: CacheKeys = CacheKeys()) -> bool:
        """Whether ``admit`` of all of ``token_ids`` (or of a KVRequest) would succeed now."""
        self._check_open()
        if isinstance(token_ids, KVRequest):
            self._check_not_foreign(token_ids)
            self._own(token_ids)
            self._check_tokens(token_ids, len(token_ids.token_ids))
            hits, total = self._prefix_hits(token_ids), len(token_ids.token_ids)
        else:
            token_ids = self._token_ids(token_ids, "token_ids")
            total = len(token_ids)
            hits = ([[] for _ in self.groups] if not self.config.enable_prefix_caching else self._cached_hits(
                self.hasher.block_hashes(token_ids, self.tokens_per_page, check.cache_keys(keys)), total))
        return self._slot_available(None) and self._fits(
            [group.admit_needs(group_hits, total) for group, group_hits in zip(self.groups, hits)], hits)

    @timed
    def can_allocate(self, request: "KVRequest | str", num_new_tokens: int) -> bool:
        req = self._running(request)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        return self._fits([group.grow_needs(alloc, num_new_tokens)
                           for group, alloc in zip(self.groups, req.allocations)])

    @timed
    def blocks_needed(self, request: "KVRequest | str", num_new_tokens: int) -> int:
        """New blocks of the first group's pool for ``num_new_tokens`` more positions (as many
        for every group drawing from it)."""
        return self.blocks_to_grow([request], [num_new_tokens])[0]

    def blocks_to_grow(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> list[int]:
        """For each pool (``pool_usage`` order): the new blocks growing each running request
        ``requests[i]`` by ``counts[i]`` positions takes, in every group drawing from the pool
        (an all-or-nothing check of several requests' growth against ``blocks_free``)."""
        reqs = self._running_list(requests, "requests")
        if len(reqs) != len(counts):
            raise InvalidInputError(f"{len(reqs)} requests but {len(counts)} counts; pass one count "
                                    "per request")
        counts = [check.count(count, "num_new_tokens") for count in counts]
        return [sum(group.grow_needs(req.allocations[group.index], count)
                    for group in memory.groups for req, count in zip(reqs, counts))
                for memory in self.memories]

    def fragmentation(self, requests: "Sequence[KVRequest]") -> tuple[int, int]:
        """(Bytes of the blocks in use beyond the bytes the tokens of ``requests`` fill, those
        bytes): each pool counted with its own blocks and clipped at zero; tokens in blocks
        given back behind a window are neither. An estimate: blocks in use include lookahead
        blocks and swapped requests' shared ones, and a prefix shared by several requests is one
        block but counted in each one's tokens."""
        wasted = stored = 0
        for memory in self.memories:  # a pool and the groups drawing from it
            layout = memory.layout
            tokens = sum(kv.num_tokens - kv.group_released_blocks(group.index) * layout.tokens_per_page
                         for group in memory.groups for kv in requests)
            held = tokens * layout.token_bytes
            wasted += max(memory.pool.num_in_use * layout.block_bytes - held, 0)
            stored += held
        return wasted, stored

    # --- sizes and counts (what a scheduler or an adapter asks instead of reading the parts) -----
    def pool_usage(self) -> list[PoolUsage]:
        """Each pool's blocks in use, free and copied, and its block bytes (one pool for most
        models; a hybrid model's groups of different block bytes have one each)."""
        self._check_open()
        return [PoolUsage(memory.pool.num_in_use, memory.pool.num_free,
                          sum(group.blocks_copied for group in memory.groups), memory.layout.block_bytes)
                for memory in self.memories]

    @property
    def num_blocks(self) -> int:
        """Blocks (logical pages) in the first group's pool (every group's, when they share one)."""
        return self.groups[0].pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: clean ones and cached ones (evicted when taken), less,
        with a shared KV budget, the clean ones its free bytes would not back."""
        return self.memories[0].available(with_budget=True)

    @property
    def num_blocks_in_use(self) -> int:
        return self.groups[0].pool.num_in_use

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks held by requests, in every group."""
        return sum(memory.pool.num_in_use * memory.layout.block_bytes for memory in self.memories)

    @property
    def kv_bytes_resident(self) -> int:
        """Bytes of the blocks with memory behind them, in every pool: held, cached, and free
        clean blocks not given back (``release_free_memory``)."""
        return sum(memory.pool.backing.num_backed * memory.layout.block_bytes for memory in self.memories)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding prefix-cache content."""
        return self.groups[0].pool.num_cached

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all (the first group's) layers' K and V of ``tokens_per_page`` tokens."""
        return self.layout.block_bytes

    @property
    def num_slots(self) -> int:
        return self.groups[0].slots.num_slots

    @property
    def layout_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layer groups, each with its own virtual tensors (one for most models); groups
        whose blocks have the same bytes draw from one pool (``memories``)."""
        return self.groups

    def layer_group(self, layer: int) -> KVCacheGroup:
        """The layer group holding model layer ``layer`` (its ``spec`` is the layer's rule)."""
        return self._where[check.layer_index(layer, self.config.num_layers)][0]

    def free_slots(self) -> list[int]:
        self._check_open()
        return sorted(self.groups[0].slots.free_slots())

    def is_slot_free(self, slot: int) -> bool:
        self._check_open()
        return self.groups[0].slots.is_free(check.slot_index(slot, self.num_slots))

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once. With a sliding
        window and ``chunk_tokens`` (the most tokens computed in one step: a prefill chunk),
        blocks behind the window are released as it runs, so it holds about the window plus a
        chunk (``AttentionSpec.peak_blocks``); otherwise every block of its tokens. Counted in the
        first group's pool: with groups sharing it, the blocks of all of them."""
        return sum(group.blocks_for_tokens(num_tokens, chunk_tokens) for group in self.memories[0].groups)

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None:
        """None when a request of ``num_tokens`` tokens (computed in chunks of at most
        ``chunk_tokens``, as ``blocks_for_tokens``) fits once nothing else is held; otherwise
        which limit it exceeds and what to change."""
        if num_tokens > self.config.max_model_len:
            return (f"{num_tokens} tokens exceed max_model_len {self.config.max_model_len}; "
                    "shorten it or raise max_model_len")
        for memory in self.memories:
            blocks = sum(group.blocks_for_tokens(num_tokens, chunk_tokens) for group in memory.groups)
            if blocks > memory.pool.num_blocks:
                where = "" if len(self.groups) == 1 else " in the pool of {}".format(
                    " and ".join(f"the {group.spec.describe()} layers" for group in memory.groups))
                return (f"{num_tokens} tokens need {blocks} KV blocks of {self.tokens_per_page} tokens"
                        f"{where} but the pool has {memory.pool.num_blocks}; shorten it or give the "
                        "KV cache more memory (num_blocks)")
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
        if len(self.groups) == 1:
            return self.groups[0].slots
        return GroupReads([group.slots for group in self.groups], self.config.num_layers)

    # --- what attention and the engine read ---------------------------------------------------
    def views(self) -> KVCacheViews:
        """A read-only view of this manager for a step's addressing and attention."""
        self._check_open()
        return KVCacheViews(self)

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``layer``'s K and V over every slot, ``[num_slots, max_model_len, kv_heads,
        dim]``, from its group's virtual tensors (vmem only). Touch only positions below a
        request's reservation."""
        self._check_open()
        group, index = self._where[check.layer_index(layer, self.config.num_layers)]
        return group.kv_views(index)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as block tensors ``[num_blocks, tokens_per_page, kv_heads,
        dim]`` of its group's pool, addressed through ``block_table(request, layer)`` (both
        backends)."""
        self._check_open()
        group, index = self._where[check.layer_index(layer, self.config.num_layers)]
        return group.block_views(index)

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
    def block_table(self, request: "KVRequest | str", layer: int | None = None) -> list[int]:
        """The request's blocks (in layer ``layer``'s group; default: the first group)."""
        req = self._running(request)
        if layer is None:
            return list(req.allocation.blocks)
        return self.layer_group(layer).block_table(req)

    def token_ids(self, request: "KVRequest | str") -> list[int]:
        """A copy of the request's token ids (a KVRequest's own list is ``request.token_ids``)."""
        return list(self._known(request).token_ids)

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
        """The counters and the first group's pool and mapping counts; with several layer groups,
        each later group's block counts beside them (``group<i>_blocks_*``) and
        ``kv_bytes_in_use`` over all."""
        self._check_open()
        first = self.groups[0]
        pool = first.pool.counters()
        slots = first.slots.stats
        out = {
            **{k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__},
            "prefix_hit_rate": self.stats.prefix_hit_rate,
            "usage": self.usage(),
            "blocks_total": pool.num_blocks, "blocks_in_use": pool.in_use,
            "blocks_cached": pool.cached, "blocks_clean": pool.clean, "evictions": pool.evictions,
            "host_blocks_cached": len(first.host_tier), "host_blocks_total": first.host_tier.capacity,
            "map_calls": slots.map_calls, "pages_mapped": slots.pages_mapped,
            "map_calls_saved": slots.pages_already_mapped, "unmap_calls": slots.unmap_calls,
            "pages_unmapped": slots.pages_unmapped,
            "tokens_per_page": self.tokens_per_page, "page_bytes": self.layout.page_size,
            "padding_fraction": self.layout.padding_fraction,
            "backend_map_seconds": sum(memory.backend.stats.map_seconds for memory in self.memories),
            "backend_unmap_seconds": sum(memory.backend.stats.unmap_seconds for memory in self.memories),
            "kv_bytes_in_use": self.kv_bytes_in_use,
            "kv_bytes_resident": self.kv_bytes_resident,
            "blocks_backed": pool.backed, "blocks_given_back": pool.given_back,
            "blocks_taken_again": pool.taken_again,
        }
        if self.budget is not None:  # the shared KV budget: its size, every member's use, ours
            budget = self.budget.stats()
            out.update({"kv_pool_bytes": budget["total_bytes"], "kv_pool_used_bytes": budget["used_bytes"],
                        "kv_pool_share_bytes": budget["held_bytes"], "kv_pool_members": budget["members"]})
        for group in self.groups[1:]:
            counts = group.pool.counters()
            out.update({f"group{group.index}_blocks_total": counts.num_blocks,
                        f"group{group.index}_blocks_in_use": counts.in_use,
                        f"group{group.index}_blocks_cached": counts.cached,
                        f"group{group.index}_blocks_clean": counts.clean,
                        f"group{group.index}_host_blocks_cached": len(group.host_tier)})
        return out
