"""Preemption: take a running request off the device and bring it back.

``recompute`` releases its blocks (full blocks stay in the prefix cache's LRU and may hit when the
request is admitted again); ``swap`` copies its private blocks to host swap space and releases
them, keeping the references on blocks other requests share, and ``swap_in`` maps it back into any
free slot, bit-exact. Both happen in every layer group or in none. ``estimate_preemption`` prices
both; whom to preempt, and how, is the scheduler's decision. Part of
:class:`vmemkv.KVCacheManager` (state in ``manager_state.py``).
"""

from __future__ import annotations

from typing import Literal

from vmemkv import validation as check
from vmemkv.cache.allocation import RELEASED
from vmemkv.cache.config import PreemptionEstimate
from vmemkv.cache.metrics import timed
from vmemkv.cache.manager_state import ManagerState, UnknownRequestError, WrongRequestStateError
from vmemkv.cache.plans import check_plans_budget
from vmemkv.cache.request import KVRequest


class PreemptionOps(ManagerState):
    """estimate_preemption, preempt, swap_in (mixed into KVCacheManager)."""

    @timed
    def estimate_preemption(self, request: "KVRequest | str") -> PreemptionEstimate:
        """What swapping costs (every group's private blocks) and what recomputing costs (the
        tokens past a prefix other requests keep alive in the first group)."""
        req = self._running(request)
        private = [len(group.private_blocks(alloc)) for group, alloc in zip(self.groups, req.allocations)]
        swap_bytes = sum(count * group.layout.block_bytes for count, group in zip(private, self.groups))
        first = self.groups[0]
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
                for memory in self.memories))

    @timed
    def preempt(self, request: "KVRequest | str", mode: Literal["recompute", "swap", "auto"] = "auto") -> str:
        """Take a running request off the device; returns the mode used.

        recompute: its blocks are released (cached ones may be hit when it is admitted again with
        all its tokens). swap: its private blocks are copied to host swap space and released;
        blocks shared with other requests stay referenced; ``swap_in`` brings it back
        (OutOfSwapSpaceError, changing nothing, when some group's swap space is short). A
        KVRequest preempted by recompute keeps its token ids and hash chain for its
        re-admission."""
        req = self._running(request)
        self._require_committed(req)
        mode = check.choice(mode, "preemption mode", check.PREEMPT_MODES)
        if mode == "auto":
            mode = self.estimate_preemption(req).cheaper
        if mode == "recompute":
            self.free(req)
            self._preempted.add(req.request_id)
            self.stats.preemptions_recompute += 1
            return mode
        for memory in self.memories:  # refuse before any group changes
            memory.swap.check_room(sum(len(group.private_blocks(req.allocations[group.index]))
                                       for group in memory.groups))
        for group, alloc in zip(self.groups, req.allocations):
            self.stats.swap_out_bytes += group.swap_out(alloc)
        self.stats.preemptions_swap += 1
        return mode

    def can_swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Whether ``swap_in`` (into ``slot`` when given) would find a slot and the blocks now."""
        req = self._swapped_request(request)
        slot = check.slot_index(slot, self.num_slots)
        return self._swap_in_fits(req, slot, self._swap_in_revivals(req))

    def _swapped_request(self, request) -> KVRequest:
        """The swapped-out request ``request`` names: UnknownRequestError for one not admitted,
        WrongRequestStateError for a running one."""
        try:
            req = self._known(request)
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
                for group, alloc in zip(self.groups, req.allocations)]

    def _swap_in_fits(self, req: KVRequest, slot: int | None, revive: list[dict[int, int]]) -> bool:
        """Whether ``swap_in`` finds a slot (or ``slot``) and enough blocks in every group."""
        return self._slot_available(slot) and self._fits(self._swap_in_needs(req, revive),
                                                         [list(group_revive.values()) for group_revive in revive])

    def _swap_in_needs(self, req: KVRequest, revive: list[dict[int, int]]) -> list[int]:
        """Fresh blocks each group's swap-in copies into (its swapped blocks not revived)."""
        return [len(alloc.swapped) - len(group_revive) for alloc, group_revive in zip(req.allocations, revive)]

    @timed
    def swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Bring a swapped request back into any free slot (``slot`` when given), bit-exact, in
        every group. Returns False, changing nothing, without a free slot or enough blocks
        (MappingLimitError, changing nothing, when the mapping budget does not take it)."""
        req = self._swapped_request(request)
        slot = check.slot_index(slot, self.num_slots)
        revive = self._swap_in_revivals(req)
        if not self._swap_in_fits(req, slot, revive):
            self._refused("swap_in", req, slot, self._swap_in_needs(req, revive),
                          [list(group_revive.values()) for group_revive in revive])
            return False
        groups = self.groups
        fresh = self._peek(self._swap_in_needs(req, revive), [list(group_revive.values()) for group_revive in revive])
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
        self._take(fresh)
        root = self._chain_root(req.keys)
        for group, alloc, plan, group_revive in zip(groups, req.allocations, plans, revive):
            self.stats.swap_in_bytes += group.finish_swap_in(alloc, plan, group_revive, req.token_ids,
                                                             req.chain.hashes, root)
        return True
