"""What a mutating manager operation will do, computed with no side effect: its plan.

``admit``, ``allocate``, ``fork`` and ``swap_in`` each plan (which slot, which blocks they share,
which fresh blocks ``pool.peek`` names, what they map), carry out the one refusable step (the
mapping, which the process's budget of kernel mappings may refuse) and only then change the pool
and the request. The planning step is a public method here, ``plan_admit``, ``plan_grow``,
``plan_fork`` and ``plan_swap_in``; the step that carries a plan out is a method of its own
(``_execute_admit``, ``_execute_grow``, ``_execute_fork``, ``_execute_swap_in``), which the public
operation calls on the plan it just made. A caller that must ask several managers before applying
any (``HybridKVCacheManager``: both layout groups) plans each once (``_admission`` and
``_plan_*``), checks them together (``hybrid_budget``) and has each manager execute the plan it
checked.

Reorder and truncate are planned here too (``reorder_copies``, ``_plan_reorder``,
``reorder_mapping_cost``; ``_truncate_copy``) for ``SharingOps`` and the hybrid budget alike.

``fit_or_reclaim`` is the mapping-budget check for operations that must ask it before their first
change (reorder, whose unmaps follow its maps; a hybrid operation's two groups): fit, else
reclaim stale mappings, else refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from . import validation as check
from .errors import InvalidInputError, MappingLimitError, RequestStateError
from .manager_state import ManagerState, UnknownRequestError
from .request import RELEASED, KVRequest
from .slots import MapJob, SlotBinder, kept_pages


@dataclass(slots=True)
class Plan:
    """One operation's change to a slot and the pool, planned: nothing has changed yet.

    ``slot`` is the slot it binds (admit, fork, swap in) or grows in (allocate). It first makes
    the slot's leading ``behind`` logical pages (behind the request's window) read nothing, then
    points logical pages ``first ..`` at ``mapped`` (``keep``: pages someone owns meanwhile, as in
    ``MapJob``). It takes one more reference on each block of ``share`` and takes the fresh
    blocks ``take`` (``pool.peek``, in order) from the pool."""

    slot: int
    behind: int
    first: int
    mapped: list[int]
    keep: int
    share: list[int]
    take: list[int]

    @property
    def jobs(self) -> list[MapJob]:
        """The mapping as ``slots.map_jobs`` and ``slots.mapping_cost`` take it (empty: none)."""
        return [MapJob(self.slot, self.first, self.mapped, self.keep)] if self.mapped else []


@dataclass(slots=True)
class Admission:
    """What ``admit`` reuses and reserves for one request, before its plan: the device prefix
    ``hits`` (``RELEASED`` behind the window), the host tier's blocks it copies in after them
    (``promote``, hashes) out of ``host_blocks`` host hits (with a window, hits wholly behind the
    next query's window are reused without a copy: ``RELEASED``), the tokens already computed
    (``cached``) and the tokens reserved (``num_tokens``)."""

    hits: list[int]
    promote: list[bytes]
    host_blocks: int
    cached: int
    num_tokens: int


class OperationPlans(ManagerState):
    """The planning step of admit, allocate, fork and swap in, and the step that carries out a
    planned binding (mixed into KVCacheManager through its operation groups).

    ``plan_*`` check their arguments and plan; the operations, which checked theirs already,
    call the same planning unchecked (``_plan_*``), so allocate's decode path pays nothing."""

    # --- the plans, with their arguments checked --------------------------------------------------
    def plan_admit(self, hits: list[int], num_tokens: int, slot: int | None = None) -> Plan:
        """What ``admit`` does for a request of ``num_tokens`` reserved tokens whose prefix hits
        (``match_prefix``, cut as ``admit`` cuts them) are ``hits``: binds ``slot`` (default: the
        one it would choose), maps the live hits and fresh blocks after them. Call it only when
        the admission fits (a free slot, enough free blocks): it plans, it does not check."""
        if not isinstance(hits, list) or (hits and (min(hits) < RELEASED
                                                     or max(hits) >= self.pool.num_blocks)):
            raise InvalidInputError(f"hits must be a list of block ids from match_prefix (or "
                                    f"RELEASED); got {hits!r:.80}")
        return self._plan_admit(hits, check.count(num_tokens, "num_tokens"),
                                check.slot_index(slot, self.slots.num_slots))

    def plan_grow(self, request: "KVRequest | str", num_new_tokens: int) -> Plan | None:
        """What ``allocate`` of ``num_new_tokens`` more positions maps in the request's slot and
        takes from the pool; None when they stay inside its mapped blocks. Call it only when the
        blocks fit."""
        return self._plan_grow(self._running(request), check.count(num_new_tokens, "num_new_tokens"))

    def plan_fork(self, parent: "KVRequest | str", slot: int | None = None) -> Plan:
        """What ``fork`` of ``parent`` does: binds ``slot`` (default: the one it would choose),
        shares the parent's full blocks and maps a fresh copy of its partial last block. Call it
        only when a slot (and, for a partial block, a free block) is there."""
        return self._plan_fork(self._running(parent), check.slot_index(slot, self.slots.num_slots))

    def plan_swap_in(self, request: "KVRequest | str", slot: int | None = None) -> Plan:
        """What ``swap_in`` does: binds ``slot`` (default: the one it would choose) and maps the
        request's blocks, its swapped blocks still in the prefix cache revived (shared) and the
        rest in fresh blocks. Call it only when the swap-in fits."""
        req = self._swapped_request(request)
        return self._plan_swap_in(req, check.slot_index(slot, self.slots.num_slots),
                                  self._swap_in_revivals(req))

    # --- the planning the operations call --------------------------------------------------------
    def _admission(self, req: KVRequest, num_new_tokens: int | None, token_budget: int | None,
                   max_cached_tokens: int | None) -> Admission:
        """What ``admit`` of ``req`` reuses and reserves (arguments checked by the caller);
        raises for a request already admitted or too long. Changes nothing but binding ``req``'s
        hash chain to this manager."""
        request_id, num_prompt, tokens_per_page = req.request_id, len(req.token_ids), self.tokens_per_page
        if request_id in self._requests:
            raise RequestStateError(f"request {request_id!r} is already admitted")
        self._check_length(request_id, num_prompt)
        req.chain.claim(self)  # its hash chain is this manager's from now on
        hits = self._prefix_hits(req)
        if max_cached_tokens is not None:
            hits = self._capped_hits(req, hits, max_cached_tokens // tokens_per_page)
        host_hits = self._host_hits(req, hits, num_new_tokens, token_budget)
        if max_cached_tokens is not None:
            host_hits = host_hits[:max(0, max_cached_tokens // tokens_per_page - len(hits))]
        cached = (len(hits) + len(host_hits)) * tokens_per_page
        new = num_prompt - cached if num_new_tokens is None else num_new_tokens
        if token_budget is not None:
            new = min(new, token_budget)
        self._check_length(request_id, cached + new)
        promote = host_hits
        if host_hits and self.spec.releases:
            # Host hits wholly behind the next query's window would be copied in only to be
            # released at the first commit: they (and the device hits before them) stay RELEASED.
            skip = self.spec.first_needed_block(cached, tokens_per_page) - len(hits)
            if skip > 0:
                hits, promote = [RELEASED] * (len(hits) + skip), host_hits[skip:]
        return Admission(hits, promote, len(host_hits), cached, cached + new)

    def _plan_admit(self, hits: list[int], num_tokens: int, slot: int | None) -> Plan:
        behind = hits.count(RELEASED)  # a windowed hit: blocks before its window need not be held
        live = hits[behind:]
        fresh = self.pool.peek(self._layout.logical_pages_for(num_tokens) - len(hits), exclude=live)
        return Plan(self._choose_slot(hits, behind, slot), behind, behind, live + fresh, 0, live, fresh)

    def _plan_grow(self, req: KVRequest, num_new_tokens: int) -> Plan | None:
        # Lookahead blocks are normally mapped already; one whose background mapping was refused
        # is mapped again here, so no position is ever written through a stale mapping.
        tokens_per_page, allocation = self.tokens_per_page, req.allocation
        blocks, num_tokens = allocation.blocks, allocation.num_tokens
        first = -(-num_tokens // tokens_per_page)
        end = -(-(num_tokens + num_new_tokens) // tokens_per_page)
        if end <= first:
            return None
        fresh = self.pool.peek(end - len(blocks)) if end > len(blocks) else []
        return Plan(allocation.slot, 0, first, blocks[first:end] + fresh, len(blocks), [], fresh)

    def _plan_fork(self, parent: KVRequest, slot: int | None) -> Plan:
        reserved = self._reserved_blocks(parent)
        partial = parent.allocation.num_tokens % self.tokens_per_page != 0
        behind = parent.allocation.num_released  # the child's window is the parent's: none shared behind
        shared = reserved[behind:-1] if partial else reserved[behind:]
        copy = self.pool.peek(1) if partial else []
        return Plan(self._choose_slot(reserved, behind, slot), behind, behind, shared + copy, 0,
                    shared, copy)

    def _plan_swap_in(self, req: KVRequest, slot: int | None, revived: dict[int, int]) -> Plan:
        """``revived``: ``_swap_in_revivals``'s blocks; fresh blocks take the other swapped
        blocks' places in ``req.allocation.swapped``'s order."""
        copies = [index for index, _ in req.allocation.swapped if index not in revived]
        fresh = self.pool.peek(len(copies), exclude=revived.values())
        blocks = list(req.allocation.blocks)
        for index, block in zip(copies, fresh):
            blocks[index] = block
        for index, block in revived.items():
            blocks[index] = block
        behind = req.allocation.num_released
        return Plan(self._choose_slot(blocks, behind, slot), behind, behind, blocks[behind:], 0,
                    list(revived.values()), fresh)

    def _swapped_request(self, request) -> KVRequest:
        """The swapped-out request ``request`` names (UnknownRequestError for any other)."""
        try:
            req = self._known(request)
        except UnknownRequestError:
            req = None
        if req is None or req.allocation.swapped is None:
            raise UnknownRequestError(f"request {getattr(request, 'request_id', request)!r} is not "
                                      "swapped out")
        return req

    def _swap_in_revivals(self, req: KVRequest) -> dict[int, int]:
        """Swapped full blocks still in the prefix cache (index -> block: taken, not copied
        back); the rest need fresh blocks."""
        revive = {}
        for index, _ in req.allocation.swapped:
            if index < req.allocation.num_registered:
                block = self.pool.lookup(req.chain.hashes[index])
                if block is not None:
                    revive[index] = block
        return revive

    def _plan_reorder(self, rows: list[KVRequest], sources: list[KVRequest],
                      copied: list[bool]) -> tuple[list[list[int]], list[int], list[MapJob]]:
        """Reorder's plan: each row's new block list (its source's, with a fresh block where it
        copies the partial block: ``reorder_copies``), the pages behind each row's new window
        (its source's), and the mapping jobs. The caller checked ``sum(copied)`` blocks are free."""
        fresh = iter(self.pool.peek(sum(copied)))
        blocks = [self._reserved_blocks(source) for source in sources]
        blocks = [row_blocks[:-1] + [next(fresh)] if copy else list(row_blocks)
                  for row_blocks, copy in zip(blocks, copied)]
        behind = [source.allocation.num_released for source in sources]  # a row takes its source's window
        jobs = [MapJob(row.allocation.slot, count, row_blocks[count:], keep=len(row.allocation.blocks))
                for row, row_blocks, count in zip(rows, blocks, behind)]
        return blocks, behind, jobs

    def _truncate_copy(self, req: KVRequest, num_tokens: int) -> int | None:
        """The logical page ``truncate`` to ``num_tokens`` must copy to a private block before the
        request writes it again (its new last block, when partial and shared or cached), or None."""
        keep = self.layout.logical_pages_for(num_tokens)
        last = req.allocation.blocks[keep - 1] if keep and num_tokens % self.tokens_per_page else None
        if last is None or (self.pool.ref[last] == 1 and self.pool.hash_of[last] is None):
            return None
        return keep - 1

    def _choose_slot(self, blocks: list[int], behind: int, slot: int | None = None) -> int:
        """The free slot for a request whose block list is ``blocks`` (``slot`` when given): one
        already mapping its first block when there is one (``SlotBinder.choose``); a request
        with blocks behind its window maps none there, so any."""
        return self.slots.choose(blocks[0] if blocks and not behind else None, slot)

    def _map_and_bind(self, plan: Plan) -> None:
        """Carry out a planned binding (admit, fork, swap in): the chosen slot's pages behind the
        window read nothing (a free slot's stale mappings: nobody reads them), the plan is
        mapped (the step the mapping budget may refuse, changing no mapping anyone owns), and
        the slot is bound. The caller then changes the pool and the request."""
        self.slots.unmap_behind(plan.slot, plan.behind)
        self.slots.map_blocks(plan.slot, plan.first, plan.mapped, plan.keep)
        self.slots.bind(slot=plan.slot, behind=plan.behind)


def reorder_copies(tokens_per_page: int, rows: list[KVRequest],
                   sources: list[KVRequest]) -> list[bool]:
    """Which rows of ``reorder`` get a copy of their source's partial block. A source's partial
    block moves (no copy) to the first row that takes it, itself first, but only when the source
    is reordered too (its own reference is dropped): a source that keeps running keeps writing
    that block, so whoever takes it gets a copy."""
    owner: dict[int, int] = {}  # id(source) -> the row that takes its partial block
    for i, (row, source) in enumerate(zip(rows, sources)):
        if row is source:
            owner[id(source)] = i
    reordered = {id(row) for row in rows}
    for i, source in enumerate(sources):
        if id(source) in reordered:
            owner.setdefault(id(source), i)
    return [source.allocation.num_tokens % tokens_per_page != 0 and owner.get(id(source)) != i
            for i, source in enumerate(sources)]


def reorder_mapping_cost(slots: SlotBinder, jobs: list[MapJob], behind: list[int]) -> tuple[int, int]:
    """(The most mappings held extra at any step, those held extra at the end) of reorder's
    jobs: every row is mapped first, then unmapped behind its new window (a row reads its old
    pages until the maps are done)."""
    mapped = [slots.mapping_cost([job])[1] for job in jobs]
    final = [slots.mapping_cost([job], count)[1] for job, count in zip(jobs, behind)]
    held = total = sum(mapped)
    for before, after in zip(mapped, final):
        total += after - before
        held = max(held, total)
    return held, total


def fit_or_reclaim(shortfall: Callable[[], str | None],
                   mappers: Iterable[tuple[SlotBinder, list[MapJob]]], what: str) -> None:
    """Refuse (MappingLimitError) unless an operation's mappings fit the process's budget;
    nothing is changed but mapping state no request owns. ``shortfall()`` says what does not fit
    (None: it fits). When something does not, each mapper's stale mappings (free slots, and pages
    past what its ``jobs`` keep of their slots) are reclaimed first, as ``SlotMapper.map_jobs``
    would on a refusal, and the budget is asked again."""
    if shortfall() is None:
        return
    for slots, jobs in mappers:
        slots.reclaim_stale(kept_pages(jobs))
    short = shortfall()
    if short is not None:
        raise MappingLimitError(
            f"refused to {what}: {short}; nothing was changed. Use a larger page_size, fewer slots "
            "or a shorter max_model_len, or raise vm.max_map_count")
