"""Decode attention for many sequences in one SDPA call.

A decode query (one new token) attends all of its sequence's keys. When several decoding
sequences sit in consecutive slots ``[lo, hi)``, their keys for one layer are one zero-copy strided
view of the slot reservation, ``k_cache[lo:hi, :longest]``; a boolean length mask hides each
row's positions past its own length. Block tables get the same call after gathering their blocks
into a padded tensor (a copy: ``gather_padded``).

Grouped-query attention is folded into the query dimension: the ``G = Hq / Hk`` query heads that
share a KV head become ``G`` queries of that head (``[B, Hk, G, D]``), so SDPA needs no
``enable_gqa`` expansion of K/V (measured 1.7x faster than ``enable_gqa`` on CPU, tiny-llama shape).
Prefill stays per sequence: padding queries into one masked call measured slower than SDPA's
causal kernel per sequence (5.1 ms vs 26 ms, 32 prompts of 16-128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # packed imports this module
    from .packed import SequenceSpan

# Batch when padding to the longest costs less than per-sequence calls: a per-sequence SDPA call
# costs about as much as reading this many extra key rows in the batch (measured: ~60 us per
# call vs ~0.15 us per padded key row, one thread).
CALL_COST_IN_ROWS = 256


@dataclass
class DecodeBatch:
    """Decoding spans read in one call. ``members``: span indices in batch-row order; ``lo``:
    the first slot when rows are consecutive slots (vmem), else -1 (gathered)."""

    members: list[int]
    read_len: int
    lo: int = -1
    rows: torch.Tensor | None = None  # packed query rows of the members, int64 [B]
    mask: torch.Tensor | None = None  # [B, 1, 1, read_len] bool, True where a key is read

    def finish(self, spans: list[SequenceSpan], device: torch.device) -> None:
        lengths = torch.tensor([spans[i].length for i in self.members], device=device)
        self.rows = torch.tensor([spans[i].query_start for i in self.members], device=device)
        self.mask = (torch.arange(self.read_len, device=device) < lengths[:, None])[:, None, None, :]


def worth_batching(lengths: list[int]) -> bool:
    """True when one call over ``len(lengths)`` rows padded to the longest beats one call each."""
    if len(lengths) < 2:
        return False
    return len(lengths) * max(lengths) <= sum(lengths) + CALL_COST_IN_ROWS * len(lengths)


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


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DecodeBatch,
           scaling: float | None, output: torch.Tensor) -> None:
    """``query`` ``[1, Hq, T, D]`` (packed); ``k``/``v`` ``[B, read_len, Hk, D]``; writes the
    members' rows of ``output`` ``[1, T, Hq, D]``."""
    num_rows, num_kv_heads = k.shape[0], k.shape[2]
    _, num_heads, _, head_dim = query.shape
    q = query[0].index_select(1, batch.rows).transpose(0, 1)  # [B, Hq, D]
    q = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=batch.mask, scale=scaling)
    output[0].index_copy_(0, batch.rows, out.reshape(num_rows, num_heads, head_dim))


def gather_padded(blocks: torch.Tensor, table: torch.Tensor, read_len: int) -> torch.Tensor:
    """Block tensor ``[num_blocks, P, Hk, D]`` gathered through a padded table ``[B, W]`` into
    ``[B, read_len, Hk, D]`` (a copy of ``B * W`` blocks)."""
    num_rows, width = table.shape
    gathered = blocks.index_select(0, table.reshape(-1))
    return gathered.view(num_rows, width * blocks.shape[1], *blocks.shape[2:])[:, :read_len]
