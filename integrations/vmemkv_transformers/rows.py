"""Row bookkeeping of a ``VmemkvCache``: each batch row is one manager request in one of a run of
consecutive slots. Admitting rows (with the cache keys that name their model and padding), growing
them step by step with the token ids fed, checking the attention mask, beam reorders (remapping
pages) and row expansion (forks) live here, as a mixin of
:class:`vmemkv_transformers.cache.VmemkvCache`, which owns the state they work on:
``manager``, ``_rows``, ``_first_slot``, ``_length``, ``_tracked``, ``_windowed``, ``_model_key``,
``_prefix``, ``_request_counter``, ``peak_pages_in_use`` and ``peak_kv_bytes``.

Rows of a manager that releases blocks behind a window all start with one prefix hit length:
the batch's next forward starts at the shortest hit, and a row that hit more would have given
back blocks that forward's window reads."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import torch

from vmemkv import CacheKeys, ConfigError, KVRequest, NoFreeSlotError, OutOfBlocksError


def blocks_free(manager) -> str:
    """The free blocks, for an error message. A row needs as many new blocks in each layer group
    (one page size, one prefix-hit length, one reservation), so the group with the fewest free
    blocks is the short one: it is named first."""
    groups = manager.layout_groups
    if len(groups) == 1:
        return f"{manager.num_free_blocks} pages free of {manager.num_blocks}"
    short, *rest = sorted(groups, key=lambda group: group.num_free_blocks)
    others = ", ".join(f"the {group.spec.describe()} layers' group {group.num_free_blocks} of "
                       f"{group.num_blocks}" for group in rest)
    return (f"the {short.spec.describe()} layers' group has {short.num_free_blocks} pages free of "
            f"{short.num_blocks} ({others})")


@dataclass
class _Row:
    """One batch row: its manager request (token ids, keys, allocation) and its mask."""

    kv: KVRequest
    masked: frozenset[int]  # prompt positions the attention mask hides (part of the salt)


class _RowBookkeeping:
    """The rows of a ``VmemkvCache`` and what changes them (see the module docstring)."""

    def _new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._request_counter)}"

    def _keys(self, masked: frozenset[int]) -> CacheKeys:
        if not self._tracked:
            return CacheKeys(cache_salt=f"untracked-{uuid.uuid4().hex}")  # never matched
        if self._model_key is None:  # no model attached: a key private to this cache
            self._model_key = f"cache-{self._prefix}"
        if not masked:
            pattern = ""
        elif masked == frozenset(range(len(masked))):
            pattern = f"left{len(masked)}"
        else:
            pattern = hashlib.sha256(repr(sorted(masked)).encode()).hexdigest()
        return CacheKeys(cache_salt=f"hf|{self._model_key}|{pattern}")

    @staticmethod
    def _masked_positions(mask: torch.Tensor | None, start: int, count: int,
                          batch: int) -> list[frozenset[int]] | None:
        """Per row, the positions in ``[start, start + count)`` that a 2-D mask hides (none
        without a mask); None when the mask cannot be read that way."""
        if mask is None:
            return [frozenset()] * batch
        if mask.ndim != 2 or tuple(mask.shape) != (batch, start + count):
            return None
        cols = mask[:, start:].to("cpu") == 0
        if not bool(cols.any()):
            return [frozenset()] * batch
        return [frozenset(start + j for j in row.nonzero().flatten().tolist()) for row in cols]

    def _find_slots(self, count: int, prefer: int | None = None) -> int:
        """The first of ``count`` consecutive free slots (``prefer`` when it is such a start)."""
        if prefer is not None and self._slots_free(range(prefer, prefer + count)):
            return prefer
        for first in range(self.manager.num_slots - count + 1):
            if self._slots_free(range(first, first + count)):
                return first
        raise NoFreeSlotError(
            f"a batch of {count} rows needs {count} consecutive free slots; free slots are "
            f"{self.manager.free_slots()} of {self.manager.num_slots} (max_batch_size); release "
            "other caches' rows or build the manager with more slots")

    def _slots_free(self, slots: range) -> bool:
        """Whether every slot in ``slots`` exists and is free."""
        return slots.stop <= self.manager.num_slots and all(self.manager.is_slot_free(s) for s in slots)

    def _admit(self, token_ids: list[list[int]], masked: list[frozenset[int]] | None,
               num_new_tokens: int | None) -> list[int]:
        """Admit one request per row into consecutive slots; returns each row's cached tokens."""
        batch = len(token_ids)
        if masked is None:  # a mask we cannot read: the KV context is unknown
            self._tracked, masked = False, [frozenset()] * batch
        first = self._find_slots(batch)
        requests = [KVRequest(self._new_request_id(), list(ids), self._keys(masked[i]))
                    for i, ids in enumerate(token_ids)]
        common = None
        if self._windowed:  # every row attends from one window start: one prefix hit length
            common = min(len(self.manager.match_prefix(kv)[0]) for kv in requests) * self.manager.tokens_per_page
        cached = self._admit_rows(requests, first, num_new_tokens, common)
        if len(set(cached)) > 1 and self._windowed:  # a window of a shorter hit was not cached
            for kv in requests:
                self.manager.free(kv)
            cached = self._admit_rows(requests, first, num_new_tokens, 0)
        self._rows = [_Row(kv, hidden) for kv, hidden in zip(requests, masked)]
        self._first_slot = first
        self._note_peak()
        return cached

    def _admit_rows(self, requests: list[KVRequest], first: int, num_new_tokens: int | None,
                    max_cached_tokens: int | None) -> list[int]:
        """Admit each request into slot ``first + i``; all or none (OutOfBlocksError)."""
        cached = []
        for i, kv in enumerate(requests):
            hit = self.manager.admit(kv, num_new_tokens=num_new_tokens, slot=first + i,
                                     max_cached_tokens=max_cached_tokens)
            if hit is None:
                free = blocks_free(self.manager)  # as the refusal found them
                for done in requests[:i]:
                    self.manager.free(done)
                raise OutOfBlocksError(
                    f"cannot admit row {i} of {len(requests)} ({len(kv.token_ids)} tokens): {free}; "
                    "release rows or give the manager more num_blocks")
            cached.append(hit)
        return cached


    def _check_mask(self, mask: torch.Tensor | None, count: int) -> None:
        """New positions may be masked only where the row's salt says so."""
        masked = self._masked_positions(mask, self._length, count, len(self._rows))
        if masked is None:
            raise ConfigError(
                f"VmemkvCache needs a 2-D attention mask covering the cached and new tokens "
                f"({self._length} + {count}); got shape {tuple(mask.shape)}")
        for row, hidden in zip(self._rows, masked):
            if not hidden <= row.masked:
                raise ConfigError(
                    f"positions {sorted(hidden - row.masked)[:8]} are masked out after the prompt was "
                    "admitted; the prefix cache would register K/V under the wrong context. Pad only "
                    "the prompt (left padding)")

    def _reserve(self, count: int, ids: list[list[int]] | None) -> None:
        """Reserve positions up to ``length + count`` in every row, recording their token ids:
        every row or none (each row's ids checked and each group's blocks counted first)."""
        end = self._length + count
        growth = [self._growth(i, row.kv, end, ids) for i, row in enumerate(self._rows)]
        # each pool's blocks for every row, in every group drawing from it
        needed = self.manager.blocks_to_grow([row.kv for row in self._rows], [grow for grow, _ in growth])
        if any(blocks > pool.blocks_free for blocks, pool in zip(needed, self.manager.pool_usage())):
            raise OutOfBlocksError(
                f"growing {len(self._rows)} row(s) to {end} positions needs {max(needed)} more "
                f"block(s); {blocks_free(self.manager)}. Release rows or give the manager more "
                "num_blocks; call cache.release() before reuse")
        for i, (row, (grow, new)) in enumerate(zip(self._rows, growth)):
            # every group's blocks were counted above, so only the manager's own check of them
            # could refuse here (the mapping budget raises instead)
            if (grow or new) and not self.manager.allocate(row.kv, grow, new):  # appends new to token_ids
                raise OutOfBlocksError(f"row {i}'s growth to {end} positions was refused although every "
                                       f"layer group had the blocks counted for it (rows before it grew); "
                                       f"{blocks_free(self.manager)}")
        self._note_peak()

    def _growth(self, i: int, kv: KVRequest, end: int, ids: list[list[int]] | None) -> tuple[int, list[int]]:
        """(Positions to reserve, token ids to append) for row ``i`` to reach ``end``;
        ConfigError when the ids fed disagree with the prompt it was admitted with."""
        known = len(kv.token_ids)  # the ids the request has: the prompt, then what was fed
        if ids is None:
            return max(end - kv.num_tokens, 0), [0] * max(end - known, 0)
        if known > self._length:  # admitted with more ids than computed: they must agree
            agreed = kv.token_ids[self._length:min(known, end)]
            if ids[i][:len(agreed)] != agreed:
                raise ConfigError(f"row {i} is fed other token ids than the prompt it was admitted with")
        return max(end - kv.num_tokens, 0), ids[i][max(known - self._length, 0):]


    def _reorder(self, targets: list[int], sources: list[int]) -> None:
        """Rows ``targets[i]`` become copies of rows ``sources[i]`` (as they were)."""
        kvs = [row.kv for row in self._rows]
        before = self.manager.pool_usage()
        if not self.manager.reorder([kvs[t] for t in targets], [kvs[s] for s in sources]):
            raise OutOfBlocksError(
                f"reordering {len(targets)} rows needs blocks for the copied partial blocks; "
                f"{blocks_free(self.manager)}; give the manager more num_blocks")
        # the copies were held next to the blocks they replaced, within the call
        after = self.manager.pool_usage()
        held = [now.blocks_in_use + now.blocks_copied - then.blocks_copied for now, then in zip(after, before)]
        self.peak_pages_in_use = max(self.peak_pages_in_use, held[0])
        self.peak_kv_bytes = max(self.peak_kv_bytes,
                                 sum(count * pool.block_bytes for count, pool in zip(held, after)))
        # each row keeps its KVRequest (the manager copied the source's content into it); the
        # mask travels with the content
        masks = [row.masked for row in self._rows]
        for target, source in zip(targets, sources):
            self._rows[target] = _Row(kvs[target], masks[source])

    def _repeat_rows(self, repeats: int) -> None:
        """Row ``i`` becomes rows ``i * repeats .. i * repeats + repeats - 1`` (as
        ``repeat_interleave``): new rows are forks (shared pages), in the slots after ours."""
        old = self._rows
        count = len(old) * repeats
        after_ours = range(self._first_slot + len(old), self._first_slot + count)
        in_place = self._slots_free(after_ours)
        first = self._first_slot if in_place else self._find_slots(count)
        start = len(old) if in_place else 0
        forked: list[_Row] = []
        for i in range(start, count):
            parent = old[i // repeats]
            child = self.manager.fork(parent.kv, self._new_request_id(), slot=first + i)
            if child is None:
                for row in forked:
                    self.manager.free(row.kv)
                raise OutOfBlocksError(f"expanding {len(old)} rows x {repeats} needs a block per "
                                       f"partial block copy; {blocks_free(self.manager)}")
            forked.append(_Row(child, parent.masked))
        if in_place:
            self._rows = old + forked
            self._reorder(list(range(len(old))), [i // repeats for i in range(len(old))])
        else:
            for row in old:
                self.manager.free(row.kv)
            self._rows, self._first_slot = forked, first
        self._note_peak()

    def _note_peak(self) -> None:
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.manager.num_blocks_in_use)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.manager.kv_bytes_in_use)
