"""Copy-on-write sharing: ``fork`` (a new request sharing a running one's full blocks), ``reorder``
(beam search: rows become copies of other rows by remapping blocks) and ``truncate`` (forget the
tail of a request, copying its new last block first if someone else can see it).

Full blocks are immutable once written, so they are shared by reference (``pool.acquire``); only
a partial last block, the one a request still writes, is ever copied. Part of
:class:`vmemkv.KVCacheManager` (see ``manager_state.py`` for the state these methods work on).
"""

from __future__ import annotations

from typing import Sequence

from . import validation as check
from .errors import PageStateError
from .kv_metrics import timed
from .manager_state import ManagerState, _Request
from .slots import MapJob


class SharingOps(ManagerState):
    """fork, reorder, truncate (mixed into KVCacheManager)."""

    @timed
    def fork(self, parent_id: str, child_id: str, slot: int | None = None) -> bool:
        """Start ``child_id`` as a copy of ``parent_id`` in another slot (``slot`` when given):
        full blocks shared, the partial last block copied. Returns False, changing nothing, without
        a slot (or not ``slot``) or a block."""
        parent = self._running(parent_id)
        child_id = check.request_id(child_id, "child_id")
        slot = check.slot_index(slot, self.slots.num_slots)
        if child_id in self._requests:
            raise PageStateError(f"request {child_id!r} already exists")
        self._require_committed(parent)
        partial = parent.num_tokens % self.tokens_per_page != 0
        if not self._slot_available(slot) or (partial and not self.pool.num_free):
            return False
        reserved = self._reserved_blocks(parent)
        shared = reserved[:-1] if partial else reserved
        copy = self.pool.peek(1) if partial else []
        slot = self.slots.choose(reserved[0] if reserved else None, slot)
        self.slots.map_jobs([MapJob(slot, 0, shared + copy)])
        self.slots.bind(slot=slot)
        self.pool.acquire(shared)
        if partial:
            copy = [self._copy_of(reserved[-1], *self.pool.take(copy))]
        self._requests[child_id] = _Request(
            child_id, parent.keys, list(parent.token_ids), blocks=shared + copy,
            num_tokens=parent.num_tokens, num_computed=parent.num_computed,
            hashes=list(parent.hashes), num_registered=parent.num_registered, slot=slot)
        self.stats.forks += 1
        return True

    @timed
    def reorder(self, request_ids: Sequence[str], source_ids: Sequence[str]) -> bool:
        """Beam-search reorder: request ``request_ids[i]`` becomes a copy of ``source_ids[i]``
        (as they were before the call). Full blocks are remapped, never copied; a partial block is
        copied only when more than one request takes it. Returns False, changing nothing, when
        the copies need more free blocks than there are."""
        rows = [self._running(r) for r in check.request_id_list(request_ids, "request_ids")]
        sources = [self._running(s) for s in check.request_id_list(source_ids, "source_ids")]
        if len(rows) != len(sources) or len({id(row) for row in rows}) != len(rows):
            raise PageStateError(f"reorder needs distinct requests, one source each; got "
                                 f"{list(request_ids)} from {list(source_ids)}")
        for source in sources:
            self._require_committed(source)
        # A source's partial block moves (no copy) to the first row that takes it, itself first,
        # but only when the source is reordered too (its own reference is dropped below): a
        # source that keeps running keeps writing that block, so whoever takes it gets a copy.
        owner: dict[str, int] = {}
        for i, (row, source) in enumerate(zip(rows, sources)):
            if row is source:
                owner[source.request_id] = i
        reordered = {id(row) for row in rows}
        for i, source in enumerate(sources):
            if id(source) in reordered:
                owner.setdefault(source.request_id, i)
        copied = [s.num_tokens % self.tokens_per_page != 0 and owner.get(s.request_id) != i
                  for i, s in enumerate(sources)]
        if sum(copied) > self.pool.num_free:
            return False
        # Plan every row's blocks, map all rows at once (refusable), then move the references.
        fresh = iter(self.pool.peek(sum(copied)))
        reserved = [self._reserved_blocks(s) for s in sources]
        plans = [blocks[:-1] + [next(fresh)] if copy else list(blocks)
                 for blocks, copy in zip(reserved, copied)]
        self.slots.map_jobs([MapJob(row.slot, 0, blocks, keep=len(row.blocks))
                             for row, blocks in zip(rows, plans)])
        snapshots = [(list(s.token_ids), s.num_tokens, s.num_computed, list(s.hashes),
                      s.num_registered, s.keys) for s in sources]
        self.pool.take([blocks[-1] for blocks, copy in zip(plans, copied) if copy])
        for blocks, source_blocks, copy in zip(plans, reserved, copied):
            self.pool.acquire(blocks[:-1] if copy else blocks)
            if copy:
                self._copy_of(source_blocks[-1], blocks[-1])
        for row in rows:  # their old blocks, lookahead included
            self.pool.release(reversed(row.blocks))
        for row, blocks, (tokens, num_tokens, num_computed, hashes, registered, keys) in zip(
                rows, plans, snapshots):
            # the keys travel with the content: later block hashes continue the source's chain
            row.keys, row.blocks, row.token_ids, row.num_tokens = keys, blocks, tokens, num_tokens
            row.num_computed, row.hashes, row.num_registered = num_computed, hashes, registered
        return True

    @timed
    def truncate(self, request_id: str, num_tokens: int) -> bool:
        """Forget every position from ``num_tokens`` on (rejected speculative tokens, a cropped
        cache). Blocks past the new end are released; if the new last block is partial and shared
        or cached, it is copied to a private block first, since the request will write it again.
        Returns False, changing nothing, when that copy finds no free block."""
        req = self._running(request_id)
        self._require_committed(req)
        num_tokens = check.count(num_tokens, "num_tokens")
        if not num_tokens <= req.num_tokens:
            raise PageStateError(f"request {request_id!r} has {req.num_tokens} tokens; cannot "
                                 f"truncate it to {num_tokens}")
        keep = self.layout.logical_pages_for(num_tokens)
        last = req.blocks[keep - 1] if keep and num_tokens % self.tokens_per_page else None
        private = last is None or (self.pool.ref[last] == 1 and self.pool.hash_of[last] is None)
        if not private:
            if not self.pool.num_free:
                return False
            copy = self.pool.peek(1)
            self.slots.map_blocks(req.slot, keep - 1, copy, keep=len(req.blocks))
            req.blocks[keep - 1] = self._copy_of(last, self.pool.take(copy)[0])
            self.pool.release([last])
        self.pool.release(reversed(req.blocks[keep:]))
        del req.blocks[keep:]
        full = num_tokens // self.tokens_per_page
        del req.token_ids[num_tokens:]
        del req.hashes[full:]
        req.num_registered = min(req.num_registered, full)
        req.num_tokens = req.num_computed = num_tokens
        return True
