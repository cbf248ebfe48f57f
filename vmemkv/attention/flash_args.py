"""Varlen FlashAttention arguments for one step: pure functions of the spans and the views' shapes.

vmem: a layer's slot view ``[num_slots, max_tokens, Hk, D]`` has slot stride ``S`` and token stride
``s``. When ``S`` is a whole number ``R`` of token strides, the reservation of every slot is one
uniformly strided tensor ``[num_slots * R, Hk, D]`` (row stride ``s``), and slot ``i``'s token ``t``
is its row ``i * R + t``. So one varlen call with ``cu_seqlens_k[b] = slot_b * R`` and
``seqused_k[b] = length_b`` attends every sequence of the step, prefill and decode together, with no
block table and no copy. The token-major layout gives ``R`` = the slot's padded token count; the
per-layer layout is uniform too (its ``R`` spans the other layers' tensors, which no row touches).

Block tables: the same call with ``block_table`` ``[B, max_blocks]`` over the pool's block view
``[num_blocks, block_size, Hk, D]``; FlashAttention-2 needs ``block_size % 256 == 0``.

Everything here runs on the host and returns CPU tensors or plain ints; ``StepMetadata`` uploads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmemkv.cache.request import RELEASED
from vmemkv.attention.packed import SequenceSpan

INT32_MAX = 2**31 - 1
FA2_BLOCK_MULTIPLE = 256  # FlashAttention-2's paged KV needs blocks of a multiple of 256 tokens


class FlashUnsupportedError(ValueError):
    """These views or spans cannot be expressed as FlashAttention arguments: fall back."""


@dataclass(frozen=True)
class VarlenArgs:
    """Host-side varlen arguments. Sequences are in kernel order: ``order[i]`` is the span index of
    the kernel's sequence ``i``. ``query_rows`` gathers the packed queries into kernel order (and
    scatters the output back); ``None`` when the packed order already is the kernel order."""

    order: list[int]
    cu_seqlens_q: list[int]  # [B + 1]
    cu_seqlens_k: list[int]  # [B + 1]
    seqused_k: list[int]  # [B]
    max_seqlen_q: int
    max_seqlen_k: int
    query_rows: list[int] | None = None  # [total_q]
    block_table: list[list[int]] | None = None  # [B, max_blocks], padded with block 0 (never read)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The integer arguments as CPU int32 tensors (``query_rows`` int64), for tests."""
        out = {name: torch.tensor(getattr(self, name), dtype=torch.int32)
               for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")}
        if self.query_rows is not None:
            out["query_rows"] = torch.tensor(self.query_rows, dtype=torch.long)
        if self.block_table is not None:
            out["block_table"] = torch.tensor(self.block_table, dtype=torch.int32)
        return out


# --- vmem: slot views as one uniformly strided tensor ---------------------------------------------

def slot_rows(view: torch.Tensor) -> int:
    """Rows per slot ``R`` of the flattened view, or raise ``FlashUnsupportedError`` when the slot
    view is not uniformly strided (slot stride not a whole number of token strides, slots
    overlapping, or a last dim that is not contiguous)."""
    if view.dim() != 4:
        raise FlashUnsupportedError(f"a slot view is [num_slots, tokens, kv_heads, dim], got {tuple(view.shape)}")
    slot_stride, token_stride, _, dim_stride = view.stride()
    if dim_stride != 1:
        raise FlashUnsupportedError(f"the last dim must be contiguous, got strides {view.stride()}")
    if token_stride <= 0 or slot_stride % token_stride:
        raise FlashUnsupportedError(
            f"slot stride {slot_stride} is not a multiple of the token stride {token_stride}: the slots "
            "are not one uniformly strided tensor")
    rows = slot_stride // token_stride
    if rows < view.shape[1]:
        raise FlashUnsupportedError(f"slots overlap: {rows} token rows per slot < {view.shape[1]} tokens")
    return rows


def flat_rows(view: torch.Tensor, rows_per_slot: int) -> int:
    """Rows of the flattened tensor: up to the last slot's last token, no further (the extent the
    slot view itself covers)."""
    return (view.shape[0] - 1) * rows_per_slot + view.shape[1]


def flatten_slots(view: torch.Tensor, rows_per_slot: int | None = None) -> torch.Tensor:
    """The slot view as ``[rows, Hk, D]`` over the same memory (``as_strided``: no copy, touches
    nothing). Row ``slot * rows_per_slot + t`` is slot ``slot``'s token ``t``."""
    rows_per_slot = slot_rows(view) if rows_per_slot is None else rows_per_slot
    _, token_stride, head_stride, _ = view.stride()
    shape = (flat_rows(view, rows_per_slot), view.shape[2], view.shape[3])
    return view.as_strided(shape, (token_stride, head_stride, 1), view.storage_offset())


def slot_geometry(k_view: torch.Tensor, v_view: torch.Tensor) -> int:
    """Rows per slot shared by a layer's K and V views; raises ``FlashUnsupportedError`` when the
    views cannot be flattened or the kernel's int32 row offsets would overflow."""
    rows = slot_rows(k_view)
    if slot_rows(v_view) != rows or k_view.shape != v_view.shape or k_view.stride() != v_view.stride():
        raise FlashUnsupportedError(f"K and V views differ: {tuple(k_view.shape)} {k_view.stride()} vs "
                                    f"{tuple(v_view.shape)} {v_view.stride()}")
    if flat_rows(k_view, rows) > INT32_MAX:
        raise FlashUnsupportedError(
            f"{k_view.shape[0]} slots x {rows} rows pass int32 (cu_seqlens_k is int32): use fewer "
            "slots or a shorter max_model_len")
    return rows


def slot_varlen_args(spans: list[SequenceSpan], rows_per_slot: int, num_rows: int) -> VarlenArgs:
    """Arguments for the flattened slot tensor of ``num_rows`` rows: sequences ordered by slot, so
    ``cu_seqlens_k`` increases (it is documented as cumulative) and ends at ``num_rows``."""
    if not spans:
        raise FlashUnsupportedError("no sequences in this step")
    order = sorted(range(len(spans)), key=lambda i: spans[i].slot)
    if len({spans[i].slot for i in order}) != len(order):
        raise FlashUnsupportedError("two sequences share a slot")
    cu_q, cu_k, used, rows = [0], [], [], []
    for i in order:
        span = spans[i]
        cu_q.append(cu_q[-1] + span.num_queries)
        cu_k.append(span.slot * rows_per_slot)
        used.append(span.length)
        rows.extend(range(span.query_start, span.query_start + span.num_queries))
    cu_k.append(num_rows)
    if any(s.length > rows_per_slot or s.slot * rows_per_slot + s.length > num_rows for s in spans):
        raise FlashUnsupportedError("a sequence reaches past its slot")
    identity = rows == list(range(len(rows)))
    return VarlenArgs(order, cu_q, cu_k, used, max(s.num_queries for s in spans),
                      max(s.length for s in spans), None if identity else rows)


def slot_varlen_arguments(spans: list[SequenceSpan], k_view: torch.Tensor, v_view: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, VarlenArgs]:
    """Flattened K, V ``[rows, Hk, D]`` and the varlen arguments for one layer's slot views."""
    rows_per_slot = slot_geometry(k_view, v_view)
    k_flat, v_flat = flatten_slots(k_view, rows_per_slot), flatten_slots(v_view, rows_per_slot)
    return k_flat, v_flat, slot_varlen_args(spans, rows_per_slot, k_flat.shape[0])


# --- block tables ----------------------------------------------------------------------------------

def fa2_block_size_supported(block_size: int) -> bool:
    """FlashAttention-2's paged KV reads blocks of a multiple of 256 tokens only (FA3 and FA4 don't
    have this limit); smaller blocks must fall back to another kernel."""
    return block_size > 0 and block_size % FA2_BLOCK_MULTIPLE == 0


def fill_released(table: "tuple[int, ...] | list[int]") -> list[int]:
    """A block table for FlashAttention, which may load a tile before a sliding window's start:
    the leading blocks released behind the window (``RELEASED``, -1) point at the first held
    block (written, so finite; the masked rows are multiplied by 0). Reads that start at the
    window (SDPA, Triton) keep ``RELEASED``, which no read takes."""
    released = 0
    while released < len(table) and table[released] == RELEASED:
        released += 1
    if not released or released == len(table):
        return list(table)
    return [table[released]] * released + list(table[released:])


def block_varlen_args(spans: list[SequenceSpan], block_size: int) -> VarlenArgs:
    """Arguments for block tables: sequences in packed order (each carries its own table, so no
    reordering), ``cu_seqlens_k`` the cumulative lengths, tables padded with block 0, blocks
    released behind a window pointing at the first held one (``fill_released``)."""
    if not spans:
        raise FlashUnsupportedError("no sequences in this step")
    cu_q, cu_k, used, tables = [0], [0], [], []
    for span in spans:
        needed = -(-span.length // block_size)
        if len(span.block_table) < needed:
            raise FlashUnsupportedError(f"a sequence of {span.length} tokens has {len(span.block_table)} "
                                        f"blocks of {block_size}; it needs {needed}")
        cu_q.append(cu_q[-1] + span.num_queries)
        cu_k.append(cu_k[-1] + span.length)
        used.append(span.length)
        tables.append(fill_released(span.block_table[:needed]))
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    rows = [r for s in spans for r in range(s.query_start, s.query_start + s.num_queries)]
    query_rows = None if rows == list(range(len(rows))) else rows
    return VarlenArgs(list(range(len(spans))), cu_q, cu_k, used, max(s.num_queries for s in spans),
                      max(s.length for s in spans), query_rows, tables)
