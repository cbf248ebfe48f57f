"""Triton decode attention over the two KV addressings that the A/B compares.

One kernel, one query token per sequence, GQA, online softmax over tiles of ``BLOCK_N`` keys with
fp32 accumulation, optional split-K (flash-decoding) with a small combine kernel. Only the
addressing of a key differs, chosen by the ``PAGED`` compile-time flag:

* **vmem (contiguous)**: ``k_cache[slot_ids[b], t]`` of a strided ``[num_slots, max_tokens,
  kv_heads, head_dim]`` view (a slot view of the token-major layout: huge slot and token strides,
  last dim contiguous).
* **paged (block table)**: ``k_blocks[block_tables[b, t // block_size], t % block_size]`` of a
  ``[num_blocks, block_size, kv_heads, head_dim]`` view.

A layer may add a sliding window ``W`` (the loop starts at ``seq_lens[b] - W``: nothing behind
it is read), soft-capping (``c * tanh(s / c)``, tanh by ``exp`` for the interpreter) and per-head
sink logits (in the softmax denominator: the decode kernel's, or the combine kernel's with split-K).
Argument checks live in ``decode_checks``.

A quantized cache (int8 / fp8 rows with a float32 scale per group of a row's values,
``memory/quantized_rows.py``, ``QUANTIZED``): each tile's bytes are loaded with their groups'
scales and multiplied in registers into the query's dtype before the dots.

The kernel reads only positions ``t < seq_lens[b]`` (clamped to what the view can address): every
K/V load and every block-table load is masked, so an unmapped page past a sequence's end is never
touched. Offsets are computed in int64, since slot and block strides of the token-major layout
pass 2^31 elements.

CUDA tensors run compiled kernels. CPU tensors run the same kernels under Triton's interpreter,
which needs ``TRITON_INTERPRET=1`` in the environment before ``triton`` is first imported (Triton
decorates its own library functions at import); otherwise CPU tensors raise ``ValueError``. The
interpreter is for tests: it is slow, in Triton 3.9 it computes ``tl.dot`` on bf16 wrongly, and it
copies each argument's *whole* storage before a launch and back after it, so on CPU never pass a
view of a reserved virtual range that has unmapped pages.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton  # noqa: F401 - the package must be importable
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError(
        "vmemkv.attention.triton_decode needs Triton (pip install triton); "
        "use the SDPA attention (vmemkv.attention.ContiguousAttention) without it") from exc

from vmemkv.attention.decode_checks import (check_block_tables, check_inputs, check_slot_ids, check_variant,
                                           query_and_output)

__all__ = ["decode_attention_contiguous", "decode_attention_paged", "default_num_splits", "triton_interprets"]

_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 256


# --- kernels ----------------------------------------------------------------------------------
# Plain functions, turned into Triton kernels by _kernels(): compiled for CUDA, interpreted for CPU.

def _decode_kernel(
    Q, K, V, Out, PartialOut, PartialLse,
    Index,  # slot_ids [B] (contiguous) or block_tables [B, max_blocks] (paged)
    SeqLens,
    Sinks,  # [Hq] float32 sink logits (HAS_SINKS)
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,  # sliding window in tokens, 0: none
    softcap_scale,  # softmax scale / softcap (SOFTCAP)
    softcap_log2,  # softcap * log2(e) (SOFTCAP)
    capacity,  # tokens one sequence can address: max_tokens, or max_blocks * block_size
    stride_qb, stride_qh,
    stride_k_outer, stride_k_token, stride_k_head,  # outer: slot stride or block stride
    stride_v_outer, stride_v_token, stride_v_head,
    KScale, VScale,  # [outer, tokens, Hk, groups] float32 scales (QUANTIZED)
    stride_ks_outer, stride_ks_token, stride_ks_head,
    stride_vs_outer, stride_vs_token, stride_vs_head,
    stride_ob, stride_oh,
    stride_index_b,
    stride_pb, stride_ph, stride_ps,  # partial out [B, Hq, splits, D]
    stride_lb, stride_lh,  # partial lse [B, Hq, splits], last dim contiguous
    num_splits,
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_H: tl.constexpr,  # GROUP padded to a tl.dot-friendly power of two (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16)
    BLOCK_N: tl.constexpr,  # keys per tile
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per block (paged only)
    SPLIT: tl.constexpr,  # write fp32 partials + lse for the combine kernel
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dots instead of tf32
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    QUANTIZED: tl.constexpr,  # K/V bytes with scales
    FP8: tl.constexpr,  # the bytes are fp8 e4m3, passed as uint8 (QUANTIZED)
    SCALE_GROUP: tl.constexpr,  # values one scale covers (QUANTIZED)
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + batch).to(tl.int32)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), capacity)
    first = tl.maximum(seq_len - window, 0) if window > 0 else 0  # the window start
    per_split = (seq_len - first + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < GROUP
    q_heads = kv_head * GROUP + heads
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q_ptrs = Q + batch.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    if PAGED:
        k_base = K + kv_head * stride_k_head
        v_base = V + kv_head * stride_v_head
        ks_base = KScale + kv_head * stride_ks_head
        vs_base = VScale + kv_head * stride_vs_head
        table = Index + batch.to(tl.int64) * stride_index_b
    else:
        slot = tl.load(Index + batch).to(tl.int64)
        k_base = K + slot * stride_k_outer + kv_head * stride_k_head
        v_base = V + slot * stride_v_outer + kv_head * stride_v_head
        ks_base = KScale + slot * stride_ks_outer + kv_head * stride_ks_head
        vs_base = VScale + slot * stride_vs_outer + kv_head * stride_vs_head

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        if PAGED:
            block = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
            within = (tokens % BLOCK_SIZE).to(tl.int64)
            k_rows = block * stride_k_outer + within * stride_k_token
            v_rows = block * stride_v_outer + within * stride_v_token
            ks_rows = block * stride_ks_outer + within * stride_ks_token
            vs_rows = block * stride_vs_outer + within * stride_vs_token
        else:
            k_rows = tokens.to(tl.int64) * stride_k_token
            v_rows = tokens.to(tl.int64) * stride_v_token
            ks_rows = tokens.to(tl.int64) * stride_ks_token
            vs_rows = tokens.to(tl.int64) * stride_vs_token
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_base + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0)
        v = tl.load(v_base + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0)
        if QUANTIZED:  # bytes times their groups' scales, in the query's dtype
            if FP8:  # e4m3 bits into a float's (bias 127, not 7) times 2^120: no fp8 type, which the
                # interpreter cannot cast (inline: a helper would need jitting of its own)
                k = (((k.to(tl.int32) & 0x80) << 24) | ((k.to(tl.int32) & 0x7F) << 20)).to(
                    tl.float32, bitcast=True) * 1.329227995784916e36
                v = (((v.to(tl.int32) & 0x80) << 24) | ((v.to(tl.int32) & 0x7F) << 20)).to(
                    tl.float32, bitcast=True) * 1.329227995784916e36
            groups = dims[None, :] // SCALE_GROUP
            k_scale = tl.load(ks_base + ks_rows[:, None] + groups, mask=kv_mask, other=0.0)
            v_scale = tl.load(vs_base + vs_rows[:, None] + groups, mask=kv_mask, other=0.0)
            k = (k.to(tl.float32) * k_scale).to(Q.dtype.element_ty)
            v = (v.to(tl.float32) * v_scale).to(Q.dtype.element_ty)

        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if SOFTCAP:  # softcap * tanh(scores * scale / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            scores = (1.0 - 2.0 / (tl.exp(2.0 * scores * softcap_scale) + 1.0)) * softcap_log2
        else:
            scores = scores * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if HAS_SINKS and not SPLIT:  # the sink joins the denominator (with split-K: in the combine)
        sink = tl.load(Sinks + q_heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        l_i = l_i * tl.exp2(m_i - m_new) + tl.exp2(sink - m_new)
        acc = acc * tl.exp2(m_i - m_new)[:, None]
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # a sequence (or split) with no keys gives 0
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        p_ptrs = (PartialOut + batch.to(tl.int64) * stride_pb + q_heads[:, None] * stride_ph
                  + split * stride_ps + dims[None, :])
        tl.store(p_ptrs, out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_ptrs = PartialLse + batch.to(tl.int64) * stride_lb + q_heads * stride_lh + split
        tl.store(lse_ptrs, lse, mask=head_mask)
    else:
        o_ptrs = Out + batch.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)


def _combine_kernel(
    PartialOut, PartialLse, Out, Sinks,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    row = batch.to(tl.int64) * stride_pb + head * stride_ph
    lse = tl.load(PartialLse + batch.to(tl.int64) * stride_lb + head * stride_lh + splits, mask=split_mask,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m > float("-inf"), m, 0.0)  # no split saw a key: every weight is exp2(-inf) = 0
    weights = tl.exp2(lse - m)
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    parts = tl.load(PartialOut + row + splits[:, None] * stride_ps + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + batch.to(tl.int64) * stride_ob + head * stride_oh + dims, out.to(Out.dtype.element_ty),
             mask=dim_mask)


def triton_interprets() -> bool:
    """Whether Triton runs in interpreter mode in this process: it does when ``TRITON_INTERPRET=1``
    was set before ``triton`` was first imported (its own library functions are decorated then)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    if isinstance(tl.sum, (InterpretedFunction, JITFunction)):
        return isinstance(tl.sum, InterpretedFunction)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # a Triton whose tl.sum is not jitted


@functools.cache
def _kernels():
    """(decode, combine) kernels in the mode Triton's own library was built in: interpreted or
    compiled. Built on first use, so importing this module needs no GPU."""
    if triton_interprets():
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(_decode_kernel), InterpretedFunction(_combine_kernel)
    from triton.runtime.jit import JITFunction
    return JITFunction(_decode_kernel), JITFunction(_combine_kernel)


# --- launch -------------------------------------------------------------------------------------

@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of the key range per (sequence, kv head): enough programs to fill the GPU about twice,
    at least ``_MIN_TOKENS_PER_SPLIT`` keys each, at most ``_MAX_SPLITS``. 1 on CPU."""
    if device.type != "cuda":
        return 1
    programs = max(1, batch * num_kv_heads)
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = -(-2 * _num_sms(index) // programs)
    by_length = max(1, -(-max_seq_len // _MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch(q, k, v, index, stride_index_b, seq_lens, scale, capacity, outer_strides, *, paged: bool,
            block_size: int, out, num_splits, max_seq_len, block_n, num_warps, num_stages,
            window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
            kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    q, out = query_and_output(q, out)
    if batch == 0:
        return out
    interpret = triton_interprets()
    if q.device.type == "cpu" and not interpret:
        raise ValueError("CPU tensors run only under Triton's interpreter, and triton was imported without "
                         "TRITON_INTERPRET=1: set it in the environment before triton is first imported, "
                         "or pass CUDA tensors")
    check_variant(q, window, softcap, sinks)
    if sinks is not None:
        sinks = sinks.contiguous()  # the kernels load them as float32
    if num_splits is None:
        longest = capacity if max_seq_len is None else max_seq_len
        num_splits = default_num_splits(batch, num_kv_heads, min(longest, window or longest), q.device)
    num_splits = max(1, min(int(num_splits), max(1, capacity)))
    if block_n is None:  # 32 under the interpreter (fewer wasted lanes); on GPU, 64 up to 256-byte rows
        block_n = 32 if interpret or head_dim * q.element_size() > 256 else 64
    block_h = max(16, _next_pow2(group))
    block_d = max(16, _next_pow2(head_dim))
    decode, combine = _kernels()
    split = num_splits > 1
    if split:
        partial = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # unused
    scale_log2 = float(scale) * math.log2(math.e)
    k_scale, v_scale = kv_scales if kv_scales is not None else (q, q)  # unread without QUANTIZED
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8:  # read as bytes, widened by bit operations in the kernel
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    ks_strides = k_scale.stride()[:3] if kv_scales is not None else (0, 0, 0)
    vs_strides = v_scale.stride()[:3] if kv_scales is not None else (0, 0, 0)
    decode[(batch, num_kv_heads, num_splits)](
        q, k, v, out, partial, lse, index, seq_lens, sinks if sinks is not None else seq_lens, scale_log2,
        window or 0, float(scale) / softcap if softcap else 0.0,
        softcap * math.log2(math.e) if softcap else 0.0, capacity,
        q.stride(0), q.stride(1),
        outer_strides[0], k.stride(1), k.stride(2),
        outer_strides[1], v.stride(1), v.stride(2),
        k_scale, v_scale, *ks_strides, *vs_strides,
        out.stride(0), out.stride(1),
        stride_index_b,
        partial.stride(0) if split else 0, partial.stride(1) if split else 0, partial.stride(2) if split else 0,
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        num_splits,
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGED=paged, BLOCK_SIZE=block_size, SPLIT=split, IEEE=q.dtype == torch.float32,
        SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, QUANTIZED=kv_scales is not None,
        SCALE_GROUP=head_dim // kv_scales[0].shape[3] if kv_scales is not None else 1, FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        combine[(batch, num_q_heads)](
            partial, lse, out, sinks if sinks is not None else lse,
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(num_splits)),
            HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


def decode_attention_contiguous(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                                out: torch.Tensor | None = None, num_splits: int | None = None,
                                max_seq_len: int | None = None, check_bounds: bool = False,
                                block_n: int | None = None, num_warps: int = 4,
                                num_stages: int = 2, window: int | None = None,
                                softcap: float | None = None, sinks: torch.Tensor | None = None,
                                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention over virtually contiguous (vmem) K/V.

    ``q`` ``[B, Hq, D]``; ``k_cache``/``v_cache`` strided ``[num_slots, max_tokens, Hk, D]`` views
    (last dim contiguous), in q's dtype, or int8 / float8_e4m3fn with ``kv_scales``, their float32
    scales ``[num_slots, max_tokens, Hk, groups]`` (``memory/quantized_rows.py``); sequence ``b`` attends to ``k_cache[slot_ids[b], :seq_lens[b]]``.
    Returns ``[B, Hq, D]`` in q's dtype (into ``out`` when given).

    ``num_splits`` fixes the split-K factor (default: from the batch, heads and ``max_seq_len``,
    the longest length in the batch if the caller knows it, else ``max_tokens``). Lengths are
    clamped to ``[0, max_tokens]`` in the kernel; ``check_bounds=True`` instead checks lengths
    and slot ids on the host and raises ``ValueError`` (it synchronizes with the device).
    ``window``: attend the last ``window`` keys only (read from there); ``softcap``: logit
    soft-capping; ``sinks``: ``[Hq]`` sink logits (see ``variants``).
    """
    check_inputs(q, k_cache, v_cache, seq_lens, ("k_cache", "v_cache"), out, kv_scales)
    check_slot_ids(slot_ids, q, seq_lens, k_cache, check_bounds)
    max_tokens = k_cache.shape[1]
    return _launch(q, k_cache, v_cache, slot_ids, 0, seq_lens, scale, max_tokens,
                   (k_cache.stride(0), v_cache.stride(0)), paged=False, block_size=1, out=out,
                   num_splits=num_splits, max_seq_len=max_seq_len, block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages, window=window, softcap=softcap,
                   sinks=sinks, kv_scales=kv_scales)


def decode_attention_paged(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           max_seq_len: int | None = None, check_bounds: bool = False,
                           block_n: int | None = None, num_warps: int = 4,
                           num_stages: int = 2, window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention over a block-table (paged) KV cache.

    ``k_blocks``/``v_blocks`` strided ``[num_blocks, block_size, Hk, D]`` views (last dim
    contiguous), in q's dtype, or int8 / float8_e4m3fn with ``kv_scales`` ``[num_blocks,
    block_size, Hk, groups]`` float32; ``block_tables`` ``[B, max_blocks]`` int32 (int64
    accepted); token ``t`` of sequence ``b`` is ``k_blocks[block_tables[b, t // block_size], t %
    block_size]``. Entries past a sequence's length are never read. Other arguments as in
    ``decode_attention_contiguous``; ``check_bounds=True`` also checks the entries each sequence
    reads (from its window start) against ``num_blocks``.
    """
    check_inputs(q, k_blocks, v_blocks, seq_lens, ("k_blocks", "v_blocks"), out, kv_scales)
    block_tables = check_block_tables(block_tables, q, seq_lens, k_blocks, window, check_bounds)
    block_size = k_blocks.shape[1]
    capacity = block_tables.shape[1] * block_size
    return _launch(q, k_blocks, v_blocks, block_tables, block_tables.stride(0), seq_lens, scale, capacity,
                   (k_blocks.stride(0), v_blocks.stride(0)), paged=True, block_size=block_size, out=out,
                   num_splits=num_splits, max_seq_len=max_seq_len, block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages, window=window, softcap=softcap,
                   sinks=sinks, kv_scales=kv_scales)
