"""Preemption: take a running request off the device and bring it back.

``recompute`` releases its blocks (full blocks stay in the prefix cache's LRU and may hit when the
request is admitted again); ``swap`` copies its private blocks to host swap space and releases
them, keeping the references on blocks other requests share, and ``swap_in`` maps it back into any
free slot, bit-exact. ``estimate_preemption`` prices both; whom to preempt, and how, is the
scheduler's decision. Part of :class:`vmemkv.KVCacheManager` (state in ``manager_state.py``).
"""

from __future__ import annotations

from typing import Literal

from . import validation as check
from .cache_config import PreemptionEstimate
from .kv_metrics import timed
from .plans import OperationPlans, Plan
from .request import RELEASED, KVRequest


class PreemptionOps(OperationPlans):
    """estimate_preemption, preempt, swap_in (mixed into KVCacheManager)."""

    @timed
    def estimate_preemption(self, request: "KVRequest | str") -> PreemptionEstimate:
        req = self._running(request)
        private = [b for b in self._live(self._reserved_blocks(req)) if self.pool.ref[b] == 1]
        swap_bytes = len(private) * self.layout.block_bytes
        surviving = 0
        for block in req.allocation.blocks:  # a prefix kept alive by other requests will hit again
            if block != RELEASED and self.pool.ref[block] > 1 and self.pool.hash_of[block] is not None:
                surviving += self.tokens_per_page
            else:
                break
        recompute = max(req.allocation.num_computed - surviving, 0)
        return PreemptionEstimate(
            swap_bytes, recompute, 2 * swap_bytes / self.config.swap_bytes_per_second,
            recompute / self.config.prefill_tokens_per_second, len(private) <= self.swap.num_free)

    @timed
    def preempt(self, request: "KVRequest | str", mode: Literal["recompute", "swap", "auto"] = "auto") -> str:
        """Take a running request off the device; returns the mode used.

        recompute: its blocks are released (cached ones may be hit when it is admitted again with
        all its tokens). swap: its private blocks are copied to host swap space and released;
        blocks shared with other requests stay referenced; ``swap_in`` brings it back. A KVRequest
        preempted by recompute keeps its token ids and hash chain for its re-admission."""
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
        private = [i for i, b in enumerate(self._reserved_blocks(req))
                   if b != RELEASED and self.pool.ref[b] == 1]
        self.swap.check_room(len(private))
        self._trim_lookahead(req)
        host = self.swap.store(self.block_window(), [req.allocation.blocks[i] for i in private])
        self.pool.release(reversed([req.allocation.blocks[i] for i in private]))
        self.slots.release(req.allocation.slot)
        req.allocation.swap_out(list(zip(private, host)))
        self.stats.preemptions_swap += 1
        self.stats.swap_out_bytes += len(private) * self.layout.block_bytes
        return mode

    def can_swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Whether ``swap_in`` (into ``slot`` when given) would find a slot and the blocks now."""
        req = self._swapped_request(request)
        return self._revivals_if_it_fits(req, check.slot_index(slot, self.slots.num_slots)) is not None

    def _revivals_if_it_fits(self, req: KVRequest, slot: int | None) -> dict[int, int] | None:
        """The swapped request's blocks still cached in the pool (``_swap_in_revivals``), or None
        when ``swap_in`` would find no slot (or not ``slot``) or not enough blocks."""
        revive = self._swap_in_revivals(req)
        needed = len(req.allocation.swapped) - len(revive)
        revived_cached = sum(self.pool.ref[b] == 0 for b in revive.values())
        if self._slot_available(slot) and needed <= self.pool.num_free - revived_cached:
            return revive
        return None

    @timed
    def swap_in(self, request: "KVRequest | str", slot: int | None = None) -> bool:
        """Bring a swapped request back into any free slot (``slot`` when given), bit-exact.
        Returns False, changing nothing, without a free slot or enough blocks."""
        req = self._swapped_request(request)
        slot = check.slot_index(slot, self.slots.num_slots)
        revive = self._revivals_if_it_fits(req, slot)
        if revive is None:
            return False
        self._execute_swap_in(req, self._plan_swap_in(req, slot, revive), revive)
        return True

    def _execute_swap_in(self, req: KVRequest, plan: Plan, revive: dict[int, int]) -> None:
        """Carry out ``plan`` (``_plan_swap_in`` of ``revive``: ``_revivals_if_it_fits``); the
        mapping may be refused (MappingLimitError), leaving the request swapped."""
        self._map_and_bind(plan)  # refused: it stays swapped
        self.pool.acquire(plan.share)
        self.pool.take(plan.take)
        copied = [host for index, host in req.allocation.swapped if index not in revive]  # plan.take's order
        self.swap.load(self.block_window(), copied, plan.take)
        self.swap.discard([host for index, host in req.allocation.swapped if index in revive])
        behind, allocation = plan.behind, req.allocation
        allocation.swap_in(plan.slot, allocation.blocks[:behind] + plan.mapped)
        for index, block in zip(range(behind, allocation.num_registered), allocation.blocks[behind:]):
            if self.pool.hash_of[block] is None:
                self._register(req, index)
        self.stats.swap_in_bytes += len(copied) * self.layout.block_bytes
