"""Slots: what each slot's virtual addresses point to (mapping state, never ownership).

All ``num_slots`` slots live in one reservation, slot ``s`` at virtual pages
``[s * slot_pages, (s + 1) * slot_pages)``, so one strided tensor per layer covers every slot
(``[slot, token, kv_head, dim]``), which is what ``cache_batch_idx``-style kernels want.

Pages behind a request's sliding window (``release_behind``) are unmapped, or point at one shared
"hole" page where the backend needs the range mapped (CUDA: FlashAttention may load a tile
before the window start); on CPU an unmapped page faults on a read, the right failure for a bug.
``_behind[slot]`` counts those leading logical pages, which batched reads leave alone.

Reclamation is deferred: when a request leaves, its slot keeps its mappings, and the next request
bound there maps only the positions whose block differs. Stale mappings are harmless because a
request only reads below its length and maps its own block before writing a position. They are
unmapped only when the OS mapping budget runs short (``reclaim_stale``).

``SlotBinder`` (here) binds slots and addresses a block table, mapping nothing; ``SlotMapper``
(``slot_mapper.py``) maps the slots' virtual tensors.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable

import torch

from vmemkv.errors import ConfigError, VmemkvError
from vmemkv.memory.layout import KVLayout
from vmemkv.memory.quantized_rows import SCALE_DTYPE
from vmemkv.memory.vmm.base import VirtualMemoryBackend


def _use_count(storage: torch.UntypedStorage) -> int:
    """Strong references to a storage (torch keeps the count; 0 where it does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(storage._cdata) if count is not None else 0


class NoFreeSlotError(VmemkvError):
    """Every slot is bound to a request."""




@dataclass
class MapJob:
    """Point logical pages ``first ..`` of ``slot`` at ``blocks``.

    ``keep`` is how many leading logical pages of the slot someone owns while the job is pending
    (at least ``first + len(blocks)``): if the mapping budget refuses the job, only pages past it
    are unmapped to make room. ``group``: the manager's layer group whose slots these are
    (``KVCacheManager.layout_groups``).
    """

    slot: int
    first: int
    blocks: list[int]
    keep: int = 0
    group: int = 0

    def __post_init__(self) -> None:
        self.keep = max(self.keep, self.first + len(self.blocks))


def kept_pages(jobs: Iterable[MapJob]) -> dict[int, int]:
    """``{slot: logical pages someone owns}`` over ``jobs`` (the most any job keeps)."""
    keep: dict[int, int] = {}
    for job in jobs:
        keep[job.slot] = max(keep.get(job.slot, 0), job.keep)
    return keep


@dataclass
class SlotStats:
    map_calls: int = 0  # backend calls after coalescing
    pages_mapped: int = 0
    pages_already_mapped: int = 0  # map calls saved by deferred reclamation
    pages_filled: int = 0  # filler pages mapped so a batched read stays inside mappings
    unmap_calls: int = 0
    pages_unmapped: int = 0


class SlotBinder:
    """Which slots (batch rows) are bound, and the pool window addressed as a block table.

    The block-table baseline uses this alone: its requests are addressed through their block
    lists, so binding a slot maps nothing. ``SlotMapper`` adds the virtual mappings.
    """

    def __init__(self, backend: VirtualMemoryBackend, layout: KVLayout, num_slots: int,
                 max_tokens: int, num_blocks: int | None = None):
        self.backend = backend
        self.layout = layout
        self.num_slots = num_slots
        self.max_tokens = max_tokens
        # the pool's blocks; the backend may hold more pages past them (SlotMapper's filler)
        self.num_blocks = num_blocks or backend.num_pages // layout.pages_per_block
        self._free = list(range(num_slots - 1, -1, -1))  # free slots; choose() takes the lowest
        self._behind = [0] * num_slots  # leading logical pages behind the bound request's window
        # SlotMapper: logical pages [behind, n) of each slot known to be mapped (0: not known)
        self._readable = [0] * num_slots
        self.stats = SlotStats()
        self._block_views = [self._layer_block_views(layer) for layer in range(layout.num_layers)]
        self._block_scale_views = ([self._layer_block_scale_views(layer) for layer in range(layout.num_layers)]
                                   if layout.scaled else [])
        self._own_references = self._reference_counts()

    # --- binding ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def choose(self, first_block: int | None = None, slot: int | None = None) -> int:
        """The free slot ``bind`` would take, changing nothing: ``slot`` when given (callers that
        need rows in consecutive slots, such as a batch viewed as one strided tensor), else one
        whose first page already maps ``first_block`` if there is one (a prefix hit then costs
        no map call), else the lowest free slot: running requests stay in a compact range of
        slots, which batched attention reads as one strided view."""
        if slot is not None:
            if slot not in self._free:
                raise NoFreeSlotError(f"slot {slot} is not free (free: {sorted(self._free)})")
            return slot
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} slots are bound; free a request first")
        index = self._free.index(min(self._free))
        if first_block is not None and len(self._free) > 1:
            index = self._slot_already_mapping(first_block, index)
        return self._free[index]

    def bind(self, first_block: int | None = None, slot: int | None = None, behind: int = 0) -> int:
        """Take the free slot ``choose`` names; its first ``behind`` logical pages are behind the
        request's window (already unmapped by ``unmap_behind``)."""
        slot = self.choose(first_block, slot)
        self._free.remove(slot)
        self.set_behind(slot, behind)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back; its mappings stay for the next request."""
        self._free.append(slot)
        self.set_behind(slot, 0)

    # --- pages behind a sliding window -----------------------------------------------------------
    def unmap_behind(self, slot: int, num_pages: int, first: int = 0) -> None:
        """Make logical pages ``[first, num_pages)`` of ``slot`` read nothing a request owns
        (mapping state only; may be refused with MappingLimitError, changing nothing). Block
        tables map nothing."""

    def release_behind(self, slot: int, num_pages: int) -> None:
        """The bound request no longer reads logical pages ``[0, num_pages)``: unmap them (or point
        them at the hole page) and remember it. Refused (MappingLimitError) changing nothing."""
        if num_pages > self._behind[slot]:
            self.unmap_behind(slot, num_pages, self._behind[slot])
            self._behind[slot] = num_pages

    def set_behind(self, slot: int, num_pages: int) -> None:
        """Record that ``slot``'s first ``num_pages`` logical pages are behind its request's
        window (after ``unmap_behind``, when the request's blocks were replaced)."""
        if num_pages < self._behind[slot]:  # pages behind the old start may be unmapped
            self._readable[slot] = 0
        self._behind[slot] = num_pages

    # --- addressing: a block table needs no mapping ----------------------------------------------
    def _slot_already_mapping(self, first_block: int, default: int) -> int:
        return default

    def map_blocks(self, slot: int, first_logical: int, blocks: list[int], keep: int = 0) -> None:
        """Block tables are the requests' block lists: nothing to map."""

    def make_readable(self, slots: list[int], num_tokens: int) -> bool:
        """Block tables have no slot views to read in a batch."""
        return False

    def release_reads(self) -> None:
        """Nothing pinned."""

    def map_jobs(self, jobs: list[MapJob]) -> None:
        """Block tables are the requests' block lists: nothing to map."""

    def mapping_cost(self, jobs: list[MapJob], behind: int = 0) -> tuple[int, int]:
        """The kernel mappings ``unmap_behind(job.slot, behind)`` then ``map_jobs(jobs)`` would add,
        without mapping: (the most held extra at any step, those held extra at the end). Block
        tables map nothing."""
        return 0, 0

    def mapping_room(self, charged_elsewhere: int = 0, charged_here: int = 0) -> int | None:
        """Mappings the backend may still add (after ``charged_elsewhere`` more elsewhere in the
        process and ``charged_here`` more in this backend: another mapper's over it); None: no
        budget."""
        return None

    def reclaim_stale(self, keep: dict[int, int] | None = None) -> None:
        """Nothing is mapped, so nothing is stale."""

    def check_request(self, slot: int, blocks: list[int], num_released: int = 0) -> None:
        """Assert that ``slot`` addresses ``blocks`` (always true of a block table)."""
        assert self._behind[slot] == num_released, (
            f"slot {slot} has {self._behind[slot]} pages behind its window, its request {num_released}")

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError("kv_backend='paged' (a block-table cache) has no slot views; use "
                          "block_views() with the requests' block tables, or kv_backend='vmem'")

    def kv_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise ConfigError("kv_backend='paged' (a block-table cache) has no slot views; use "
                          "block_scale_views() with the requests' block tables, or kv_backend='vmem'")

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V over the whole pool as vLLM-style block tensors
        ``[num_blocks, tokens_per_page, kv_heads, dim]`` (the backend's pool window)."""
        return self._block_views[layer]

    def _layer_block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        window = self.backend.pool_window().view(-1).view(layout.dtype)
        num_blocks = self.num_blocks
        shape = (num_blocks, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
        views = []
        for kv in (0, 1):
            strides, offset = layout.block_view_geometry(layer, kv)
            views.append(window.as_strided(shape, strides, offset))
        return views[0], views[1]

    def block_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized layout's scales of layer ``layer``'s K and V rows as block tensors
        ``[num_blocks, tokens_per_page, kv_heads, groups]`` float32, beside ``block_views``; None
        when the layout stores plain values."""
        return self._block_scale_views[layer] if self.layout.scaled else None

    def _layer_block_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        window = self.backend.pool_window().view(-1).view(SCALE_DTYPE)
        shape = (self.num_blocks, layout.tokens_per_page, layout.num_kv_heads, layout.scale_groups)
        views = []
        for kv in (0, 1):
            strides, offset = layout.block_scale_view_geometry(layer, kv)
            views.append(window.as_strided(shape, strides, offset))
        return views[0], views[1]

    def _reference_counts(self) -> list[int]:
        """References to each view tensor and to each distinct storage under them (tensors and
        arrays made from a view hold its storage, not the view)."""
        views = [t for pair in self._block_views + self._block_scale_views + getattr(self, "_views", [])
                 + getattr(self, "_scale_views", []) for t in pair]
        storages = {}
        for view in views:
            storage = view.untyped_storage()
            storages.setdefault((storage.device, storage.data_ptr()), storage)
        return [sys.getrefcount(view) for view in views] + [_use_count(s) for s in storages.values()]

    def count_own_references(self) -> None:
        """Take the references to the views as they are now as the mapper's own (after another
        mapper over the same backend made its views of the same storage)."""
        self._own_references = self._reference_counts()

    def views_in_use(self) -> int:
        """References to the views (or to tensors and arrays made from them) held outside; 0
        when none. Counted against the counts taken when the views were made."""
        return sum(max(now - mine, 0) for now, mine in zip(self._reference_counts(), self._own_references))

    def close(self) -> None:
        """Nothing reserved."""
