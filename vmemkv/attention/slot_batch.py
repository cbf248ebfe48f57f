"""Decode attention for many sequences in one SDPA call.

A decode query (one new token) attends all of its sequence's keys. When several decoding
sequences sit in consecutive slots ``[lo, hi)``, their keys for one layer are one zero-copy strided
view of the slot reservation, ``k_cache[lo:hi, :longest]``; a boolean length mask hides each
row's positions past its own length. Block tables get the same call after gathering their blocks
into a padded tensor (a copy: ``gather_padded``).

Grouped-query attention is folded into the query dimension: the ``G = Hq / Hk`` query heads that
share a KV head become ``G`` queries of that head (``[B, Hk, G, D]``), so SDPA needs no
``enable_gqa`` expansion of K/V (measured 1.7x faster than ``enable_gqa`` on CPU, tiny-llama shape).
With a sliding window the call reads from the window start when every member's window starts
there; otherwise its members are attended one by one (``DecodeBatch.window``), so that no read
touches a position behind a member's window.
Prefill stays per sequence here: padding queries into one masked call measured slower than SDPA's
causal kernel per sequence (5.1 ms vs 26 ms, 32 prompts of 16-128 tokens); the native CPU routine
(``cpu_prefill``) takes every prompt chunk in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from vmemkv.attention.variants import explicit_attention, needs_explicit
from vmemkv.cache.kv_spec import local_spec

if TYPE_CHECKING:  # packed imports this module
    from vmemkv.attention.packed import SequenceSpan

# Batch when padding to the longest costs less than the per-sequence calls it saves. Measured on
# CPU (one thread, caches flushed between calls as a forward's weights do, 4-32 decodes of 64-256
# tokens): one per-sequence SDPA call costs ~10-12 us on both shapes measured, and one key row
# costs about the same read batched or alone, ~1 ns per K/V element of the row (kv_heads x
# head_dim): 0.05-0.09 us on tiny-llama (2 x 32), 0.18-0.22 us on SmolLM2-135M (3 x 64). So a call
# is worth CALL_COST_IN_ELEMENTS / (kv_heads x head_dim) padded rows: 128 on tiny-llama, 42 on
# SmolLM2 (the fit gives ~10,000; rounded down so that batching does not lose where it is a tie).
CALL_COST_IN_ELEMENTS = 8192


@dataclass
class DecodeBatch:
    """Decoding spans read in one call. ``members``: span indices in batch-row order; ``lo``:
    the first slot when rows are consecutive slots (vmem), else -1 (gathered)."""

    members: list[int]
    read_len: int
    lo: int = -1
    rows: torch.Tensor | None = None  # packed query rows of the members, int64 [B] (when not first_row)
    mask: torch.Tensor | None = None  # [B, 1, 1, read_len] bool, True where a key is read; None: all
    same_length: bool = False  # every member has read_len tokens
    first_row: int | None = None  # the rows are first_row, first_row + 1, ...: sliced, not gathered
    _additive_mask: torch.Tensor | None = None  # ``mask`` in SDPA's additive form (``sdpa_mask``)

    def finish(self, spans: list[SequenceSpan], device: torch.device) -> None:
        # Plain Python over the members and numpy arrays: each small torch op here costs several
        # microseconds in a step (caches cold after the forward).
        members = [spans[i] for i in self.members]
        lengths = [span.length for span in members]
        rows = [span.query_start for span in members]
        self.same_length = min(lengths) == self.read_len
        first = rows[0]
        self.first_row = first if rows == list(range(first, first + len(rows))) else None
        if self.first_row is None:  # rows are gathered by index; consecutive ones are sliced
            self.rows = _to_device(np.array(rows, dtype=np.int64), device)
        if not self.same_length:  # every key read is seen when all members are read_len long
            mask = np.arange(self.read_len) < np.array(lengths)[:, None, None, None]
            self.mask = _to_device(mask, device)

    def window(self, window: int | None) -> tuple[int, torch.Tensor | None] | None:
        """``(start, mask)`` for a layer with this sliding window: keys are read from position
        ``start`` under ``mask`` (None: all seen). None when the members' windows start at
        different positions: one read would then touch positions behind some member's window,
        so those members are attended one by one."""
        start = local_spec(window).first_read(self.read_len - 1)  # the decode queries' first read
        if not start:
            return 0, self.mask
        return (start, None) if self.same_length else None


    def sdpa_mask(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` (from ``window``) for SDPA: the batch's own bool mask as the additive one SDPA
        would make of it (0 where a key is read, -inf elsewhere, in ``dtype``), made once per step
        instead of by SDPA in every layer's call (~3 us a call on CPU at B = 8-32)."""
        if mask is None or mask is not self.mask:
            return mask
        additive = self._additive_mask
        if additive is None or additive.dtype != dtype:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._additive_mask = additive.masked_fill_(~mask, float("-inf"))
        return additive


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def call_cost_in_rows(row_elements: int) -> int:
    """Padded key rows one per-sequence call is worth, for rows of ``row_elements`` K (or V)
    elements (kv_heads x head_dim)."""
    return max(1, CALL_COST_IN_ELEMENTS // row_elements)


def worth_batching(lengths: list[int], row_elements: int) -> bool:
    """True when one call over ``len(lengths)`` rows padded to the longest beats one call each;
    ``row_elements``: kv_heads x head_dim of the cache."""
    if len(lengths) < 2:
        return False
    return len(lengths) * max(lengths) <= sum(lengths) + call_cost_in_rows(row_elements) * len(lengths)


def slot_runs(spans: list[SequenceSpan]) -> list[list[int]]:
    """Decoding spans grouped into runs of consecutive slots (span indices in slot order)."""
    decoding = sorted((s.slot, i) for i, s in enumerate(spans) if s.num_queries == 1)
    runs: list[list[int]] = []
    previous = None
    for slot, index in decoding:
        if previous is None or slot != previous + 1:
            runs.append([])
        runs[-1].append(index)
        previous = slot
    return runs


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           batch: DecodeBatch, scale: float, output: torch.Tensor | None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """``query`` ``[1, Hq, T, D]`` (packed); ``k``/``v`` ``[B, N, Hk, D]`` with ``mask``
    ``[B, 1, 1, N]`` or None (from ``batch.window``); writes the members' rows of ``output``
    ``[1, T, Hq, D]``. ``output=None`` (the batch's rows are all the packed rows, in order):
    returns the attention ``[1, T, Hq, D]`` itself, no copy."""
    num_rows, num_kv_heads = k.shape[0], k.shape[2]
    _, num_heads, _, head_dim = query.shape
    first = batch.first_row
    q = (query[0, :, first: first + num_rows] if first is not None
         else query[0].index_select(1, batch.rows)).transpose(0, 1)  # [B, Hq, D]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if needs_explicit(softcap, sinks):
        out = explicit_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale, mask,
                                 softcap, sinks)
    else:
        q = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=batch.sdpa_mask(mask, q.dtype), scale=scale)
    out = out.reshape(num_rows, num_heads, head_dim)
    if output is None:
        return out[None]
    if first is not None:
        output[0, first: first + num_rows] = out
    else:
        output[0].index_copy_(0, batch.rows, out)
    return None


def gather_padded(blocks: torch.Tensor, table: torch.Tensor, read_len: int, start: int = 0) -> torch.Tensor:
    """Block tensor ``[num_blocks, P, Hk, D]`` gathered through a padded table ``[B, W]`` into
    ``[B, read_len - start, Hk, D]``, positions ``start .. read_len`` (a copy of the blocks from
    the one holding ``start`` on)."""
    size = blocks.shape[1]
    first = start // size
    table = table[:, first:]
    num_rows, width = table.shape
    gathered = blocks.index_select(0, table.reshape(-1))
    flat = gathered.view(num_rows, width * size, *blocks.shape[2:])
    return flat[:, start - first * size: read_len - first * size]
