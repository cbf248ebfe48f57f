"""What the KV cache manager tells without changing anything: the queries a scheduler asks
(``can_admit``, ``match_prefix``, ``blocks_needed``, ``why_never_fits``), the sizes and counts an
engine or adapter reads instead of the parts, the K/V views attention reads, a request's
allocation by id, and the stats: :class:`CacheQueries`, a part the :class:`vmemkv.KVCacheManager`
holds and calls (the manager documents each query; ``manager.py`` has the operations that change
the cache).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from vmemkv import validation as check
from vmemkv.cache.config import CacheStats
from vmemkv.cache.group import KVCacheGroup
from vmemkv.cache.hashing import CacheKeys
from vmemkv.cache.coordinator import KVCacheCoordinator
from vmemkv.cache.registry import RequestRegistry
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

    def __init__(self, manager, queries: "CacheQueries"):
        self._manager = manager
        # the queries' own bound methods, not the manager's that call them: attention calls
        # kv_views once per layer per step
        self.layer_group, self.kv_views = queries.layer_group, queries.kv_views
        self.block_views, self.batched_reads = queries.block_views, queries.batched_reads
        self.state_views, self.kv_scale_views = queries.state_views, queries.kv_scale_views
        self.block_scale_views = queries.block_scale_views

    config = property(lambda self: self._manager.config)
    layout = property(lambda self: self._manager.layout)
    tokens_per_page = property(lambda self: self._manager.tokens_per_page)
    layout_groups = property(lambda self: self._manager.layout_groups)


class CacheQueries:
    """What the manager answers without changing the cache, read from its registry and
    coordinator (``KVCacheManager`` calls these with its arguments unchecked)."""

    def __init__(self, registry: RequestRegistry, coordinator: KVCacheCoordinator, config, stats: CacheStats):
        self.registry, self.coordinator, self.config, self.stats = registry, coordinator, config, stats
        self.tokens_per_page = coordinator.tokens_per_page

    def prefix_hits(self, req: KVRequest) -> list[list[int]]:
        """``req``'s cached prefix blocks in every group, hashing only blocks its chain does not
        cover yet."""
        if not self.config.enable_prefix_caching:
            return [[] for _ in self.coordinator.groups]
        num_tokens = len(req.token_ids)
        return self.coordinator.cached_hits(
            self.registry.extend_chain(req, (num_tokens - 1) // self.tokens_per_page), num_tokens,
            not req.exact)

    # --- queries without side effects ----------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        self.registry.check_open()
        return self.coordinator.groups[0].slots.num_free

    def usage(self) -> float:
        self.registry.check_open()
        return max(memory.pool.num_in_use / memory.pool.num_blocks for memory in self.coordinator.memories)

    def match_prefix(self, token_ids: "Sequence[int] | KVRequest",
                     keys: CacheKeys = CacheKeys()) -> tuple[list[int], list[bytes]]:
        self.registry.check_open()
        if not self.config.enable_prefix_caching:
            return [], []
        if isinstance(token_ids, KVRequest):
            req = token_ids
            self.registry.check_not_foreign(req)
            self.registry.own(req)  # its hash chain is this manager's from now on
            hashes = list(self.registry.extend_chain(req, len(req.token_ids) // self.tokens_per_page))
            return self.coordinator.cached_hits(hashes, len(req.token_ids), not req.exact)[0], hashes
        token_ids = self.registry.token_ids(token_ids, "token_ids")
        hashes = self.registry.hashes_of(token_ids, keys)
        return self.coordinator.cached_hits(hashes, len(token_ids), True)[0], hashes

    def can_admit(self, token_ids: "Sequence[int] | KVRequest", keys: CacheKeys = CacheKeys()) -> bool:
        self.registry.check_open()
        if isinstance(token_ids, KVRequest):
            self.registry.check_not_foreign(token_ids)
            self.registry.own(token_ids)
            self.registry.check_tokens(token_ids, len(token_ids.token_ids))
            hits, total = self.prefix_hits(token_ids), len(token_ids.token_ids)
            hashes, lossy = token_ids.chain.hashes, not token_ids.exact
        else:
            lossy = True
            token_ids = self.registry.token_ids(token_ids, "token_ids")
            total = len(token_ids)
            hashes = self.registry.hashes_of(token_ids, keys) if self.config.enable_prefix_caching else []
            hits = ([[] for _ in self.coordinator.groups] if not self.config.enable_prefix_caching
                    else self.coordinator.cached_hits(hashes, total, lossy))
        # admit's own admission: its hits reach on into the host tiers
        admissions = self.coordinator.admissions(hashes, total, hits, None, None, None, lossy)
        return self.coordinator.admission_fits(admissions)[2]

    def can_allocate(self, request: "KVRequest | str", num_new_tokens: int) -> bool:
        req = self.registry.running(request)
        num_new_tokens = check.count(num_new_tokens, "num_new_tokens")
        return self.coordinator.fits([group.grow_needs(alloc, num_new_tokens)
                           for group, alloc in zip(self.coordinator.groups, req.allocations)])

    def blocks_needed(self, request: "KVRequest | str", num_new_tokens: int) -> int:
        return self.blocks_to_grow([request], [num_new_tokens])[0]

    def blocks_to_grow(self, requests: "Sequence[KVRequest | str]", counts: Sequence[int]) -> list[int]:
        reqs = self.registry.running_list(requests, "requests")
        if len(reqs) != len(counts):
            raise InvalidInputError(f"{len(reqs)} requests but {len(counts)} counts; pass one count "
                                    "per request")
        counts = [check.count(count, "num_new_tokens") for count in counts]
        return [sum(group.grow_needs(req.allocations[group.index], count)
                    for group in memory.groups for req, count in zip(reqs, counts))
                for memory in self.coordinator.memories]

    def fragmentation(self, requests: "Sequence[KVRequest]") -> tuple[int, int]:
        wasted = stored = 0
        for memory in self.coordinator.memories:  # a pool and the groups drawing from it
            layout = memory.layout
            tokens = sum(kv.num_tokens - kv.group_released_blocks(group.index) * layout.tokens_per_page
                         for group in memory.groups for kv in requests)
            held = tokens * layout.token_bytes
            wasted += max(memory.pool.num_in_use * layout.block_bytes - held, 0)
            stored += held
        return wasted, stored

    # --- sizes and counts (what a scheduler or an adapter asks instead of reading the parts) -----
    def pool_usage(self) -> list[PoolUsage]:
        self.registry.check_open()
        return [PoolUsage(memory.pool.num_in_use, memory.pool.num_free,
                          sum(group.blocks_copied for group in memory.groups), memory.layout.block_bytes)
                for memory in self.coordinator.memories]

    @property
    def num_blocks(self) -> int:
        return self.coordinator.groups[0].pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.memories[0].available(with_budget=True)

    @property
    def num_blocks_in_use(self) -> int:
        return self.coordinator.groups[0].pool.num_in_use

    @property
    def kv_bytes_in_use(self) -> int:
        return sum(memory.pool.num_in_use * memory.layout.block_bytes for memory in self.coordinator.memories)

    @property
    def kv_bytes_resident(self) -> int:
        return sum(memory.pool.backing.num_backed * memory.layout.block_bytes for memory in self.coordinator.memories)

    @property
    def num_cached_blocks(self) -> int:
        return self.coordinator.groups[0].pool.num_cached

    @property
    def block_bytes(self) -> int:
        return self.coordinator.first.layout.block_bytes

    @property
    def num_slots(self) -> int:
        return self.coordinator.groups[0].slots.num_slots

    @property
    def layout_groups(self) -> tuple[KVCacheGroup, ...]:
        return self.coordinator.groups

    def layer_group(self, layer: int) -> KVCacheGroup:
        return self.coordinator.where(check.layer_index(layer, self.config.num_layers))[0]

    def free_slots(self) -> list[int]:
        self.registry.check_open()
        return sorted(self.coordinator.groups[0].slots.free_slots())

    def is_slot_free(self, slot: int) -> bool:
        self.registry.check_open()
        return self.coordinator.groups[0].slots.is_free(check.slot_index(slot, self.num_slots))

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        return sum(group.blocks_for_tokens(num_tokens, chunk_tokens) for group in self.coordinator.memories[0].groups)

    def why_never_fits(self, num_tokens: int, chunk_tokens: int | None = None) -> str | None:
        if num_tokens > self.config.max_model_len:
            return (f"{num_tokens} tokens exceed max_model_len {self.config.max_model_len}; "
                    "shorten it or raise max_model_len")
        for memory in self.coordinator.memories:
            blocks = sum(group.blocks_for_tokens(num_tokens, chunk_tokens) for group in memory.groups)
            if blocks > memory.pool.num_blocks:
                where = "" if len(self.coordinator.groups) == 1 else " in the pool of {}".format(
                    " and ".join(f"the {group.spec.describe()} layers" for group in memory.groups))
                return (f"{num_tokens} tokens need {blocks} KV blocks of {self.tokens_per_page} tokens"
                        f"{where} but the pool has {memory.pool.num_blocks}; shorten it or give the "
                        "KV cache more memory (num_blocks)")
        return None

    def can_ever_fit(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        return self.why_never_fits(num_tokens, chunk_tokens) is None

    def cache_stats(self) -> CacheStats:
        self.registry.check_open()
        return dataclasses.replace(self.stats)

    def batched_reads(self):
        self.registry.check_open()
        if len(self.coordinator.groups) == 1:
            return self.coordinator.groups[0].slots
        return GroupReads([group.slots for group in self.coordinator.groups], self.config.num_layers)

    # --- what attention and the engine read ---------------------------------------------------
    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.registry.check_open()
        group, index = self.coordinator.where(check.layer_index(layer, self.config.num_layers))
        return group.kv_views(index)

    def kv_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.registry.check_open()
        group, index = self.coordinator.where(check.layer_index(layer, self.config.num_layers))
        return group.kv_scale_views(index)

    def state_views(self, layer: int) -> list[torch.Tensor]:
        self.registry.check_open()
        group, index = self.coordinator.where(check.layer_index(layer, self.config.num_layers),
                                              state=True)
        return group.state_views(index)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.registry.check_open()
        group, index = self.coordinator.where(check.layer_index(layer, self.config.num_layers))
        return group.block_views(index)

    def block_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.registry.check_open()
        group, index = self.coordinator.where(check.layer_index(layer, self.config.num_layers))
        return group.block_scale_views(index)

    def request(self, request_id: str) -> KVRequest:
        return self.registry.known(check.request_id(request_id))

    def slot_of(self, request: "KVRequest | str") -> int:
        return self.registry.running(request).allocation.slot

    def num_tokens(self, request: "KVRequest | str") -> int:
        return self.registry.running(request).allocation.num_tokens

    def num_computed_tokens(self, request: "KVRequest | str") -> int:
        return self.registry.known(request).allocation.num_computed

    def block_table(self, request: "KVRequest | str", layer: int | None = None) -> list[int]:
        req = self.registry.running(request)
        if layer is None:
            return list(req.allocation.blocks)
        return self.layer_group(layer).block_table(req)

    def token_ids(self, request: "KVRequest | str") -> list[int]:
        return list(self.registry.known(request).token_ids)

    def is_swapped(self, request: "KVRequest | str") -> bool:
        self.registry.check_open()
        if isinstance(request, KVRequest):
            return self.registry.requests.get(request.request_id) is request and request.is_swapped
        req = self.registry.requests.get(check.request_id(request))
        return req is not None and req.allocation.swapped is not None

    def request_ids(self) -> list[str]:
        self.registry.check_open()
        return list(self.registry.requests)

    def snapshot_stats(self) -> dict:
        self.registry.check_open()
        first = self.coordinator.groups[0]
        pool = first.pool.counters()
        slots = first.slots.stats
        out = {
            **{k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__},
            "prefix_hit_rate": self.stats.prefix_hit_rate,
            "usage": self.usage(),
            "blocks_total": pool.num_blocks, "blocks_in_use": pool.in_use,
            "blocks_cached": pool.cached, "blocks_clean": pool.clean, "evictions": pool.evictions,
            "host_blocks_cached": len(first.host_tier), "host_blocks_total": first.host_tier.capacity,
            "cold_blocks_cached": len(first.cold_tier), "cold_blocks_total": first.cold_tier.capacity,
            "map_calls": slots.map_calls, "pages_mapped": slots.pages_mapped,
            "map_calls_saved": slots.pages_already_mapped, "unmap_calls": slots.unmap_calls,
            "pages_unmapped": slots.pages_unmapped,
            "tokens_per_page": self.tokens_per_page, "page_bytes": self.coordinator.first.layout.page_size,
            "padding_fraction": self.coordinator.first.layout.padding_fraction,
            "backend_map_seconds": sum(memory.backend.stats.map_seconds for memory in self.coordinator.memories),
            "backend_unmap_seconds": sum(memory.backend.stats.unmap_seconds for memory in self.coordinator.memories),
            "kv_bytes_in_use": self.kv_bytes_in_use,
            "kv_bytes_resident": self.kv_bytes_resident,
            "blocks_backed": pool.backed, "blocks_given_back": pool.given_back,
            "blocks_taken_again": pool.taken_again,
        }
        if self.coordinator.budget is not None:  # the shared KV budget: its size, every member's use, ours
            budget = self.coordinator.budget.stats()
            out.update({"kv_pool_bytes": budget["total_bytes"], "kv_pool_used_bytes": budget["used_bytes"],
                        "kv_pool_share_bytes": budget["held_bytes"], "kv_pool_members": budget["members"]})
        states = [group.state_bytes for group in self.coordinator.groups if group.holds_state]
        if states:  # what each saved state costs (CacheConfig.state_cache_interval)
            out["state_bytes_per_saved_state"] = sum(states)
        for group in self.coordinator.groups[1:]:
            counts = group.pool.counters()
            out.update({f"group{group.index}_blocks_total": counts.num_blocks,
                        f"group{group.index}_blocks_in_use": counts.in_use,
                        f"group{group.index}_blocks_cached": counts.cached,
                        f"group{group.index}_blocks_clean": counts.clean,
                        f"group{group.index}_host_blocks_cached": len(group.host_tier)})
        return out
