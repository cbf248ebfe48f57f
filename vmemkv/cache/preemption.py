"""Preemption: take a running request off the device and bring it back.

``recompute`` releases its blocks (full blocks stay in the prefix cache's LRU and may hit when the
request is admitted again); ``swap`` copies its private blocks to host swap space and releases
them, keeping the references on blocks other requests share, and ``swap_in`` maps it back into any
free slot, bit-exact. Both happen in every layer group or in none. ``estimate_preemption`` prices
both; whom to preempt, and how, is the scheduler's decision. A part the
:class:`vmemkv.KVCacheManager` holds (it frees a request preempted by recompute itself).
"""

from __future__ import annotations

from vmemkv import validation as check
from vmemkv.cache.allocation import RELEASED
from vmemkv.cache.config import PreemptionEstimate
from vmemkv.cache.config import CacheConfig, CacheStats
from vmemkv.cache.coordinator import KVCacheCoordinator
from vmemkv.cache.registry import RequestRegistry, UnknownRequestError, WrongRequestStateError
from vmemkv.cache.plans import check_plans_budget
from vmemkv.cache.request import KVRequest


class Preemption:
    """Pricing preemption, swapping out and swapping in, over every group."""

    def __init__(self, registry: RequestRegistry, coordinator: KVCacheCoordinator, config: CacheConfig,
                 stats: CacheStats):
        self.registry, self.coordinator, self.config, self.stats = registry, coordinator, config, stats
        self.tokens_per_page = coordinator.tokens_per_page
        self.num_slots = coordinator.first.slots.num_slots

    def estimate(self, request: "KVRequest | str") -> PreemptionEstimate:
        req = self.registry.running(request)
        private = [len(group.private_blocks(alloc)) for group, alloc in zip(self.coordinator.groups, req.allocations)]
        swap_bytes = sum(count * group.layout.block_bytes for count, group in zip(private, self.coordinator.groups))
        first = self.coordinator.groups[0]
        surviving = 0
        for block in req.allocation.blocks:  # a prefix kept alive by other requests will hit again
            if block != RELEASED and first.pool.ref[block] > 1 and first.pool.hash_of[block] is not None:
                surviving += self.tokens_per_page
            else:
                break
        recompute = max(req.allocation.num_computed - surviving, 0)
        return PreemptionEstimate(
            swap_bytes, recompute, 2 * swap_bytes / self.config.swap_bytes_per_second,
            recompute / self.config.prefill_tokens_per_second,
            all(sum(private[group.index] for group in memory.groups) <= memory.swap.num_free
                for memory in self.coordinator.memories))

    def swap_out(self, req: KVRequest) -> None:
        """Copy a running, committed request's private blocks to host swap space and release
        them in every group (OutOfSwapSpaceError, changing nothing, when some memory's swap space
        is short)."""
        for memory in self.coordinator.memories:  # refuse before any group changes
            memory.swap.check_room(sum(len(group.private_blocks(req.allocations[group.index]))
                                       for group in memory.groups))
        for group, alloc in zip(self.coordinator.groups, req.allocations):
            self.stats.swap_out_bytes += group.swap_out(alloc)
        self.stats.preemptions_swap += 1

    def can_swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        req = self._swapped_request(request)
        slot = check.slot_index(slot, self.num_slots)
        return self._swap_in_fits(req, slot, self._swap_in_revivals(req))

    def _swapped_request(self, request) -> KVRequest:
        """The swapped-out request ``request`` names: UnknownRequestError for one not admitted,
        WrongRequestStateError for a running one."""
        try:
            req = self.registry.known(request)
        except UnknownRequestError:
            raise UnknownRequestError(f"request {getattr(request, 'request_id', request)!r} is not "
                                      "swapped out: it is not admitted (new, freed, or preempted by "
                                      "recompute); admit() it instead") from None
        if req.allocation.swapped is None:
            raise WrongRequestStateError(
                f"request {req.request_id!r} is running (slot {req.allocation.slot}), not swapped "
                "out; swap_in() brings back only a request preempt(req, 'swap') took off the device")
        return req

    def _swap_in_revivals(self, req: KVRequest) -> list[dict[int, int]]:
        """Each group's swapped blocks still cached in its pool (``swap_in_revivals``): mapped
        again, not copied."""
        return [group.swap_in_revivals(alloc, req.chain.hashes)
                for group, alloc in zip(self.coordinator.groups, req.allocations)]

    def _swap_in_fits(self, req: KVRequest, slot: int | None, revive: list[dict[int, int]]) -> bool:
        """Whether ``swap_in`` finds a slot (or ``slot``) and enough blocks in every group."""
        return self.coordinator.slot_available(slot) and self.coordinator.fits(self._swap_in_needs(req, revive),
                                                         [list(group_revive.values()) for group_revive in revive])

    def _swap_in_needs(self, req: KVRequest, revive: list[dict[int, int]]) -> list[int]:
        """Fresh blocks each group's swap-in copies into (its swapped blocks not revived)."""
        return [len(alloc.swapped) - len(group_revive) for alloc, group_revive in zip(req.allocations, revive)]

    def swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        req = self._swapped_request(request)
        slot = check.slot_index(slot, self.num_slots)
        revive = self._swap_in_revivals(req)
        if not self._swap_in_fits(req, slot, revive):
            self.coordinator.refused("swap_in", req, slot, self._swap_in_needs(req, revive),
                          [list(group_revive.values()) for group_revive in revive])
            return False
        groups = self.coordinator.groups
        fresh = self.coordinator.peek(self._swap_in_needs(req, revive), [list(group_revive.values()) for group_revive in revive])
        plans = []
        for group, alloc, group_revive in zip(groups, req.allocations, revive):  # the first chooses the slot
            plans.append(group.plan_swap_in(alloc, slot, group_revive, fresh[group.index]))
            slot = plans[0].slot
        if len(groups) > 1:
            check_plans_budget(groups, plans, "swap in")
        for group, plan in zip(groups, plans):
            group.map_and_bind(plan)  # the one refusable step: refused, it stays swapped
        for group, plan in zip(groups, plans):
            group.pool.acquire(plan.share)
        self.coordinator.take(fresh)
        root = self.registry.chain_root(req.keys)
        for group, alloc, plan, group_revive in zip(groups, req.allocations, plans, revive):
            self.stats.swap_in_bytes += group.finish_swap_in(alloc, plan, group_revive, req.token_ids,
                                                             req.chain.hashes, root)
        return True
