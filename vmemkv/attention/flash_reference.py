"""A pure-torch reference of FlashAttention-2's varlen forward, as its interface documents it.

It computes, sequence by sequence, exactly what ``flash_attn_varlen_func`` /
``torch.ops.aten._flash_attention_forward`` (varlen, ``seqused_k``, ``block_table``) promise, so
that the arguments vmemkv builds for the kernel can be checked on a CPU: only the kernel itself
then stays unchecked without a GPU.

Semantics (FlashAttention-2 >= 2.1):

* sequence ``b``'s queries are rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q``
  ``[total_q, Hq, D]``;
* its keys and values: without a block table, rows ``cu_seqlens_k[b] : cu_seqlens_k[b] + n`` of
  ``k``/``v`` ``[total_k, Hk, D]``, where ``n = seqused_k[b]`` if given, else
  ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``; with a block table, key ``t`` is
  ``k[block_table[b, t // block_size], t % block_size]`` of ``k`` ``[num_blocks, block_size, Hk, D]``
  (``n`` as before);
* causal masks align to the bottom-right corner: query ``i`` of ``m`` sees key ``j`` iff
  ``j <= i + n - m`` (so queries that follow cached tokens see those tokens);
* a local window ``window_size_left = W - 1`` (``window``: W) hides keys ``j < i + n - m - W + 1``;
  soft-capping ``c`` maps scores to ``c * tanh(scores / c)`` before the mask;
* GQA: query head ``h`` reads kv head ``h // (Hq // Hk)``;
* a query row that sees no key outputs zeros.

Only the rows a sequence uses are read (never the whole ``k``), so ``k`` may be a view over a
reserved virtual range with unmapped pages.
"""

from __future__ import annotations

import torch


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               scale: float, causal: bool = True,
                               seqused_k: torch.Tensor | None = None,
                               block_table: torch.Tensor | None = None,
                               dtype: torch.dtype = torch.float64, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """``[total_q, Hq, D]`` attention output in ``dtype`` (float64 by default)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    tables = block_table.tolist() if block_table is not None else None
    num_q_heads, num_kv_heads = q.shape[1], k.shape[-2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        rows = slice(cu_q[b], cu_q[b + 1])
        m = cu_q[b + 1] - cu_q[b]
        n = used[b] if used is not None else cu_k[b + 1] - cu_k[b]
        if m == 0 or n == 0:
            continue
        keys, values = _sequence_kv(k, v, cu_k[b], n, tables[b] if tables is not None else None)
        # keys before the first query's window are never used (nor read, in the slot case)
        first = max(0, n - m - window + 1) if causal and window else 0
        query = q[rows].to(dtype).transpose(0, 1)  # [Hq, m, D]
        keys = keys[first:].to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n - first, D]
        values = values[first:].to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (query @ keys.transpose(1, 2)) * scale  # [Hq, m, n - first]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            key_positions = torch.arange(first, n, device=q.device)[None, :]
            query_positions = torch.arange(m, device=q.device)[:, None] + (n - m)
            visible = key_positions <= query_positions
            if window:
                visible &= key_positions > query_positions - window
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: zeros
        out[rows] = (weights @ values).transpose(0, 1).to(dtype)
    return out


def _sequence_kv(k: torch.Tensor, v: torch.Tensor, start: int, n: int,
                 table: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's ``n`` keys and values ``[n, Hk, D]``, read row by row as the kernel would."""
    if table is None:
        return k[start:start + n], v[start:start + n]
    block_size = k.shape[1]
    blocks = torch.tensor(table[: -(-n // block_size)], dtype=torch.long, device=k.device)
    return (k.index_select(0, blocks).flatten(0, 1)[:n], v.index_select(0, blocks).flatten(0, 1)[:n])


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, block_table: torch.Tensor | None = None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The reference with a kernel's call signature (``flash_kernels.bundled_varlen``), in q's
    dtype: plugged into the attention classes, it runs their whole path on a CPU."""
    return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=True,
                                      seqused_k=seqused_k, block_table=block_table,
                                      window=window, softcap=softcap).to(q.dtype)
