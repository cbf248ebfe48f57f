"""``SlotMapper``: slots whose virtual tensors point at a request's blocks (the vmem backend).

A slot's mappings, its batched-read filler (and what is known readable), its pages behind a window
and what mapping them would cost (``mapping_cost``) are one page table, kept consistent in one
class. ``slots.py`` has the slot binding it extends and the module's story (deferred reclamation,
the hole page).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from vmemkv.errors import MappingLimitError
from vmemkv.memory.layout import KVLayout
from vmemkv.memory.quantized_rows import SCALE_BYTES, SCALE_DTYPE
from vmemkv.memory.slots import MapJob, SlotBinder, kept_pages
from vmemkv.memory.vmm.base import VirtualMemoryBackend
from vmemkv.memory.vmm.cpu_limits import count_range_mappings

SMALL_MAP = 16  # pages: map_jobs of at most this many token-major pages stays in plain Python


class SlotMapper(SlotBinder):
    """``hole_page``: the backend's physical page that pages behind a window point at (None:
    they are unmapped)."""

    def __init__(self, backend: VirtualMemoryBackend, layout: KVLayout, num_slots: int,
                 max_tokens: int, num_blocks: int | None = None, hole_page: int | None = None):
        super().__init__(backend, layout, num_slots, max_tokens, num_blocks)
        self.hole_page = hole_page if hole_page is not None and hole_page < backend.num_pages else None
        if self.hole_page is not None:  # masked reads of it are multiplied by 0: no NaN there
            backend.pool_window()[self.hole_page].zero_()
        self.slot_pages = layout.slot_pages(max_tokens)
        self.vrange = backend.reserve(num_slots * self.slot_pages)
        self.page_table = self.vrange.page_table  # the backend keeps it current
        self._one_page_blocks = layout.pages_per_block == 1  # token-major: block = page
        self._scratch = threading.local()
        # Filler: one slot's worth of pages past the pool's, owned by no request (see
        # make_readable); without them (a backend sized to the pool) batched reads are off.
        self._filler_base = self.num_blocks * layout.pages_per_block
        self._has_filler = backend.num_pages >= self._filler_base + self.slot_pages
        self._read_pins: dict[int, int] = {}  # slot -> leading logical pages a batched read needs
        self._views = [self._layer_views(layer) for layer in range(layout.num_layers)]
        if layout.scaled:  # counted with the views (_reference_counts)
            self._scale_views = [self._layer_scale_views(layer) for layer in range(layout.num_layers)]
        self._own_references = self._reference_counts()

    def _slot_already_mapping(self, first_block: int, default: int) -> int:
        # the first physical page of each free slot's logical page 0
        virtual = self._virtual(np.asarray(self._free), 0)[:len(self._free)]
        physical = self.layout.physical_pages(np.array([first_block]))[0]
        matches = np.flatnonzero(self.page_table[virtual] == physical)
        if not len(matches):
            return default
        free = np.asarray(self._free)
        return int(matches[np.argmin(free[matches])])  # the lowest such slot: keeps slots compact

    # --- batched reads --------------------------------------------------------------------------
    def make_readable(self, slots: list[int], num_tokens: int) -> bool:
        """Make positions ``[0, num_tokens)`` of every slot in ``slots`` (bound ones) safe to
        read, so one strided view over them can be read in a single attention call: positions
        past a request's own pages get *filler* mappings, the backend's pages past the pool,
        which no request owns (reads of them are masked; a request maps its own block over a
        position before writing it, and a stray write would land in the filler, never in another
        request's pages). Offset ``i`` of a slot maps filler page ``i``, so a slot's filler is one
        coalesced mapping. Those pages are then pinned against ``reclaim_stale`` (which the
        lookahead worker may run during the forward) until ``release_reads``. False (nothing
        pinned for these slots) without filler pages or if the mapping budget refuses. A run of
        slots already made readable this far (``_mark_readable``) costs no page-table lookup."""
        if not self._has_filler:
            return False
        logical = self.layout.logical_pages_for(num_tokens)
        readable = self._readable
        if all(readable[slot] >= logical for slot in slots):  # the steady decode step: no numpy
            self._read_pins.update(dict.fromkeys(slots, logical))
            return True
        target = min(logical + logical // 4 + 2, self.layout.logical_pages_for(self.max_tokens))
        slot_array = np.asarray(slots, dtype=np.int64)
        needed = self._readable_pages(slot_array, logical)
        if (self.page_table[needed] >= 0).all():
            self._mark_readable(slots, logical)
            self._read_pins.update(dict.fromkeys(slots, logical))
            return True
        # Fill up to ``target`` pages (a little past what this step reads), so the next steps'
        # longer reads rarely need another map call; consecutive pool pages coalesce.
        virtual = self._readable_pages(slot_array, target)
        physical = self._filler_base + virtual % self.slot_pages
        unmapped = self.page_table[virtual] < 0
        try:
            self._backend_map(virtual[unmapped], physical[unmapped])
        except MappingLimitError:
            return False
        self.stats.pages_filled += int(unmapped.sum())
        self._mark_readable(slots, target)
        self._read_pins.update(dict.fromkeys(slots, logical))
        return True

    def _mark_readable(self, slots: list[int], num_logical: int) -> None:
        """Remember that logical pages ``[behind, num_logical)`` of ``slots`` are mapped. The
        mark is cleared by whatever could unmap one of them: an unmap in the slot
        (``_unmap_mapped``) and a window start moved back (``release``, ``set_behind``); a map
        only points a mapped page elsewhere."""
        for slot in slots:
            self._readable[slot] = max(self._readable[slot], num_logical)

    def _readable_pages(self, slots: np.ndarray, num_logical: int) -> np.ndarray:
        """Virtual pages of logical pages ``[0, num_logical)`` of ``slots`` that a batched read may
        touch: none behind a slot's window (a batch of members whose windows start apart is
        attended member by member, from each window start; ``DecodeBatch.window``)."""
        logical = np.tile(np.arange(num_logical), len(slots))
        owners = np.repeat(slots, num_logical)
        ahead = logical >= np.asarray(self._behind, dtype=np.int64)[owners]
        return self._virtual(owners[ahead], logical[ahead])

    def release_reads(self) -> None:
        """The step's batched reads are done: its filler pages may be reclaimed again."""
        self._read_pins.clear()

    # --- mapping --------------------------------------------------------------------------------
    def map_blocks(self, slot: int, first_logical: int, blocks: list[int], keep: int = 0) -> None:
        """Make logical pages ``first_logical ..`` of ``slot`` point to ``blocks``, mapping only
        the pages whose current block differs (``keep`` as in ``MapJob``). All or nothing: a
        refusal changes no mapping that anyone owns."""
        if not blocks:
            return
        if len(blocks) == 1 and self._one_page_blocks:
            # The decode hot path (one token-major block): plain ints and reused one-element
            # arrays, since numpy calls on tiny arrays cost microseconds each.
            virtual_page = slot * self.slot_pages + first_logical
            block = blocks[0]
            if self.page_table.item(virtual_page) == block:
                self.stats.pages_already_mapped += 1
                return
            virtual, physical = self._one_page_arrays()
            virtual[0], physical[0] = virtual_page, block
            self._map([MapJob(slot, first_logical, blocks, keep)], virtual, physical)
            return
        self.map_jobs([MapJob(slot, first_logical, blocks, keep)])

    def map_jobs(self, jobs: list[MapJob]) -> None:
        """Carry out every job in one backend call (all slots share one reservation), so a
        refusal by the mapping budget leaves every slot as it was."""
        if self._one_page_blocks and sum(len(job.blocks) for job in jobs) <= SMALL_MAP:
            self._map_few(jobs)
            return
        virtual, physical = self._job_pages(jobs)
        stale = self.page_table[virtual] != physical
        self.stats.pages_already_mapped += len(virtual) - int(stale.sum())
        if stale.any():
            self._map(jobs, virtual[stale], physical[stale])

    def _map_few(self, jobs: list[MapJob]) -> None:
        """``map_jobs`` for a few token-major pages (a step's lookahead blocks): plain ints until
        the backend call. Right after a forward, each small numpy call costs 10-25 µs (measured
        in the decode step, B = 32), more than the mapping itself."""
        table, slot_pages = self.page_table, self.slot_pages
        virtual, physical = [], []
        for job in jobs:
            start = job.slot * slot_pages + job.first
            for offset, block in enumerate(job.blocks):
                if table.item(start + offset) != block:
                    virtual.append(start + offset)
                    physical.append(block)
        self.stats.pages_already_mapped += sum(len(job.blocks) for job in jobs) - len(virtual)
        if virtual:
            self._map(jobs, np.array(virtual, dtype=np.int64), np.array(physical, dtype=np.int64))

    def mapping_cost(self, jobs: list[MapJob], behind: int = 0) -> tuple[int, int]:
        # One VMA per run of consecutive physical pages and per unmapped gap, so a change only
        # moves the count of the pairs of neighbours it touches: count over the touched span.
        table = self.page_table
        virtual, physical = self._job_pages(jobs)
        slots = np.unique([job.slot for job in jobs]).astype(np.int64)
        released = self._virtual(np.repeat(slots, behind), np.tile(np.arange(behind), len(slots)))
        touched = np.concatenate([virtual, released])
        if not len(touched):
            return 0, 0
        start, end = max(int(touched.min()) - 1, 0), min(int(touched.max()) + 2, len(table))
        old = table[start:end]
        after_behind = old.copy()
        after_behind[released - start] = -1 if self.hole_page is None else self.hole_page
        after_jobs = after_behind.copy()
        after_jobs[virtual - start] = physical
        base = count_range_mappings(old)
        first, last = count_range_mappings(after_behind) - base, count_range_mappings(after_jobs) - base
        return max(first, last), last

    def mapping_room(self, charged_elsewhere: int = 0, charged_here: int = 0) -> int | None:
        room = getattr(self.backend, "mapping_room", None)
        if room is None:
            return None
        return room(charged_elsewhere, charged_here) if charged_here else room(charged_elsewhere)

    def _job_pages(self, jobs: list[MapJob]) -> tuple[np.ndarray, np.ndarray]:
        """The (virtual page, physical page) pairs the jobs ask for."""
        if self._one_page_blocks:  # token-major: plain lists, one array each (few short jobs)
            virtual, physical = [], []
            for job in jobs:
                start = job.slot * self.slot_pages + job.first
                virtual += range(start, start + len(job.blocks))
                physical += job.blocks
            return np.array(virtual, dtype=np.int64), np.array(physical, dtype=np.int64)
        virtual, physical = [], []
        for job in jobs:
            blocks = np.asarray(job.blocks, dtype=np.int64)
            logical = np.arange(job.first, job.first + len(blocks), dtype=np.int64)
            virtual.append(self._virtual(np.full(len(blocks), job.slot, dtype=np.int64), logical))
            physical.append(self.layout.physical_pages(blocks))
        if not virtual:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(virtual), np.concatenate(physical)

    def _map(self, jobs: list[MapJob], virtual: np.ndarray, physical: np.ndarray) -> None:
        try:
            self._backend_map(virtual, physical)
        except MappingLimitError:
            # The refused call changed nothing: make room and retry once. Stale are the free
            # slots the jobs do not bind and the jobs' slots past what their owners keep.
            self.reclaim_stale(kept_pages(jobs))
            self._backend_map(virtual, physical)
        self.stats.pages_mapped += len(virtual)

    def _backend_map(self, virtual: np.ndarray, physical: np.ndarray) -> None:
        """One backend map call, its system calls counted in ``stats.map_calls`` (raises what the
        backend raises, counting nothing)."""
        calls = self.backend.stats.map_calls
        self.backend.map(self.vrange, virtual, physical)
        self.stats.map_calls += self.backend.stats.map_calls - calls

    def _one_page_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-thread scratch arrays for one-page maps (map_lookahead may run on another thread)."""
        try:
            return self._scratch.arrays
        except AttributeError:
            arrays = self._scratch.arrays = (np.empty(1, np.int64), np.empty(1, np.int64))
            return arrays

    def reclaim_stale(self, keep: dict[int, int] | None = None) -> None:
        """Unmap what no request needs: every page of free slots, and, for slots given in
        ``keep`` as ``{slot: logical pages in use}`` (bound, or about to be), the pages past
        that count."""
        keep = dict(keep or {})
        for slot, pages in list(self._read_pins.items()):  # being read by this step's attention
            keep[slot] = max(keep.get(slot, 0), pages)
        spans = [(slot, 0) for slot in self._free if slot not in keep] + list(keep.items())
        virtual = [self._virtual_span(slot, start) for slot, start in spans]
        virtual = np.concatenate(virtual) if virtual else np.empty(0, dtype=np.int64)
        self._unmap_mapped(virtual)

    def _unmap_mapped(self, virtual: np.ndarray) -> None:
        """Unmap those of ``virtual`` that are mapped."""
        virtual = virtual[self.page_table[virtual] >= 0]
        if len(virtual):
            for slot in np.unique(virtual // self.slot_pages).tolist():
                self._readable[slot] = 0  # make_readable checks the page table again
            calls = self.backend.stats.unmap_calls
            self.backend.unmap(self.vrange, virtual)
            self.stats.unmap_calls += self.backend.stats.unmap_calls - calls
            self.stats.pages_unmapped += len(virtual)

    def unmap_behind(self, slot: int, num_pages: int, first: int = 0) -> None:
        if num_pages <= first:  # nothing behind a window (every admission without one)
            return
        logical = np.arange(first, num_pages, dtype=np.int64)
        virtual = self._virtual(np.full(len(logical), slot, dtype=np.int64), logical)
        if self.hole_page is None:
            self._unmap_mapped(virtual)
            return
        virtual = virtual[self.page_table[virtual] != self.hole_page]
        if len(virtual):
            self._backend_map(virtual, np.full(len(virtual), self.hole_page, dtype=np.int64))

    def check_request(self, slot: int, blocks: list[int], num_released: int = 0) -> None:
        super().check_request(slot, blocks, num_released)
        behind = self.mapped_blocks(slot, num_released)
        assert ((behind == -1) | (behind == (-1 if self.hole_page is None else self.hole_page))).all(), (
            f"slot {slot} maps {behind.tolist()} behind its request's window")
        logical = np.arange(num_released, len(blocks), dtype=np.int64)
        mapped = self.page_table[self._virtual(np.full(len(logical), slot, dtype=np.int64), logical)]
        expected = self.layout.physical_pages(np.asarray(blocks[num_released:], dtype=np.int64))
        assert np.array_equal(mapped, expected), (
            f"slot {slot} maps {mapped.tolist()} from page {num_released}, its request owns {blocks}")

    def mapped_blocks(self, slot: int, num_logical: int) -> np.ndarray:
        """The physical pages the first ``num_logical`` logical pages of ``slot`` point to."""
        logical = np.arange(num_logical, dtype=np.int64)
        return self.page_table[self._virtual(np.full(num_logical, slot, dtype=np.int64), logical)]

    def _virtual(self, slots: np.ndarray, logical) -> np.ndarray:
        """Virtual pages of logical page(s) ``logical`` in ``slots`` (pairwise, broadcast)."""
        if self._one_page_blocks:  # token-major: one virtual page per logical page
            return np.asarray(slots, dtype=np.int64) * self.slot_pages + logical
        logical = np.broadcast_to(np.asarray(logical, dtype=np.int64), np.shape(slots))
        per_slot = self.layout.virtual_pages(logical, self.max_tokens)
        bases = np.tile(np.asarray(slots, dtype=np.int64), self.layout.pages_per_block)
        return per_slot + bases * self.slot_pages

    def _virtual_span(self, slot: int, first_logical: int) -> np.ndarray:
        count = max(self.layout.logical_pages_for(self.max_tokens) - first_logical, 0)
        logical = np.arange(first_logical, first_logical + count, dtype=np.int64)
        return self._virtual(np.full(count, slot, dtype=np.int64), logical)

    # --- views --------------------------------------------------------------------------------
    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V over every slot, ``[num_slots, max_tokens, kv_heads, dim]``.
        Only positions a request has mapped may be touched."""
        return self._views[layer]

    def _layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        slot_elems = self.slot_pages * layout.page_size // layout.itemsize
        shape = (self.num_slots, self.max_tokens, layout.num_kv_heads, layout.head_dim)
        views = []
        for kv in (0, 1):
            strides, offset = layout.slot_view_geometry(layer, kv, self.max_tokens)
            views.append(self.backend.tensor(self.vrange, layout.dtype, shape,
                                             (slot_elems, *strides), offset * layout.itemsize))
        return views[0], views[1]

    def kv_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized layout's scales of layer ``layer``'s K and V rows over every slot,
        ``[num_slots, max_tokens, kv_heads, groups]`` float32 (a value is its byte times its group's
        scale); None when the layout stores plain values."""
        return self._scale_views[layer] if self.layout.scaled else None

    def _layer_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        slot_floats = self.slot_pages * layout.page_size // SCALE_BYTES
        shape = (self.num_slots, self.max_tokens, layout.num_kv_heads, layout.scale_groups)
        views = []
        for kv in (0, 1):
            strides, offset = layout.scale_view_geometry(layer, kv, self.max_tokens)
            views.append(self.backend.tensor(self.vrange, SCALE_DTYPE, shape, (slot_floats, *strides),
                                             offset * SCALE_BYTES))
        return views[0], views[1]

    def close(self) -> None:
        self.backend.release(self.vrange)
