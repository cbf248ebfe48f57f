"""Causal attention of a step's prompt chunks on the CPU, reading the cache in place: the native
routine of ``native/prefill_attention.c`` (the ``vmemkv._prefill_attention`` extension), float32 or
bfloat16, over K/V rows of that type or quantized (int8 / fp8 with their scales).

SDPA attends one sequence per call, over a strided view of its keys: at a 2,048-token chunk of
SmolLM2-135M (8 prompts of 256 tokens) 15-19 ms a layer at one thread, a fifth of the step. The
native routine attends every sequence of the step in one call, each KV head's group of query heads
together: 5 ms. It needs AVX-512 (``native/prefill_attention.c`` says why). ``unavailable()`` says
why it cannot run here; the engine then attends with SDPA.
"""

from __future__ import annotations

import functools

import torch

MAX_GROUP = 96  # query heads per KV head the routine takes (its work item's rows)
DTYPES = (torch.float32, torch.bfloat16)
QUANTIZED_KV = {torch.int8: 2, torch.float8_e4m3fn: 3}  # K/V with scales: the routine's codes


@functools.cache
def _extension():
    try:
        from vmemkv import _prefill_attention
    except ImportError:
        return None
    return _prefill_attention


@functools.cache
def unavailable(dtype: torch.dtype | None = None, num_q_heads: int = 1, num_kv_heads: int = 1,
                head_dim: int = 64) -> str:
    """"" when the native routine can run (for this dtype and these heads), else why not."""
    if _extension() is None:
        return ("the native prefill attention (vmemkv._prefill_attention) is not built: reinstall with a "
                "C compiler that has OpenMP (pip install -e .)")
    if not _extension().wide_vectors():
        return ("the native prefill attention needs AVX-512, which this CPU lacks (the same code spills on "
                "AVX2: 3x slower than SDPA)")
    if dtype is not None and dtype not in DTYPES:
        return f"the native prefill attention reads float32 and bfloat16, not {dtype}"
    if num_kv_heads < 1 or num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > MAX_GROUP:
        return (f"the native prefill attention takes up to {MAX_GROUP} query heads per KV head, not "
                f"{num_q_heads} over {num_kv_heads}")
    if head_dim % 4:
        return f"the native prefill attention takes head sizes that are a multiple of 4, not {head_dim}"
    return ""


class PrefillSpans:
    """The sequences one step attends with the routine, as the int32 arrays it reads: each one's
    first row in the packed batch, its new tokens, its cached tokens, and where its keys are
    (``index``: slot ids ``[B]``, or block tables ``[B, W]`` with ``block_size`` tokens a block)."""

    def __init__(self, query_start: list[int], num_queries: list[int], num_cached: list[int],
                 index: list[int] | list[list[int]], block_size: int = 0):
        self.query_start = torch.tensor(query_start, dtype=torch.int32)
        self.num_queries = torch.tensor(num_queries, dtype=torch.int32)
        self.num_cached = torch.tensor(num_cached, dtype=torch.int32)
        self.index = torch.tensor(index, dtype=torch.int32)
        self.block_size = block_size
        self.num_rows = max((s + n for s, n in zip(query_start, num_queries)), default=0)
        self.longest = max((c + n for c, n in zip(num_cached, num_queries)), default=0)


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: PrefillSpans,
                          scale: float, out: torch.Tensor, num_threads: int | None = None,
                          kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q`` ``[T, Hq, D]`` (the packed rows), ``out`` the same shape, written at the spans' rows
    only; ``k``/``v`` ``[outer, tokens, Hk, D]``: slot views (``spans.block_size`` 0, ``outer``
    the slot) or block tensors (``outer`` the block). Sequence ``b``'s query ``i`` (row
    ``query_start[b] + i``, position ``num_cached[b] + i``) attends its keys ``0 ..`` its position.
    Every last dim contiguous, all float32 or all bfloat16, on the CPU; the K/V of the new tokens
    already written. Or K/V int8 / float8_e4m3fn with ``kv_scales``, their float32 scales
    ``[outer, tokens, Hk, groups]`` (``memory/quantized_rows.py``), read as bytes where they lie."""
    if reason := unavailable(q.dtype, q.shape[1], k.shape[2], q.shape[2]):
        raise ValueError(reason)
    kv_dtype = k.dtype if kv_scales is not None else q.dtype
    if kv_scales is not None and kv_dtype not in QUANTIZED_KV:
        raise ValueError(f"kv_scales go with int8 or float8_e4m3fn K/V, not {kv_dtype}")
    tensors = {"q": (q, q.dtype), "k": (k, kv_dtype), "v": (v, kv_dtype), "out": (out, q.dtype)}
    if kv_scales is not None:
        tensors.update({"k scales": (kv_scales[0], torch.float32), "v scales": (kv_scales[1], torch.float32)})
    for name, (t, dtype) in tensors.items():
        if t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1:
            as_q = " (as q)" if dtype == q.dtype and name != "q" else ""
            raise ValueError(f"{name} must be {dtype}{as_q} on the CPU with a contiguous last dim, got {t.dtype} "
                             f"on {t.device}, strides {t.stride()}")
    if q.dim() != 3 or out.shape != q.shape or k.dim() != 4 or v.shape != k.shape or k.shape[3] != q.shape[2]:
        raise ValueError(f"shapes: q and out [T, Hq, D], k and v [outer, tokens, Hk, D]; got {tuple(q.shape)}, "
                         f"{tuple(out.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    groups = 0
    if kv_scales is not None:
        groups = kv_scales[0].shape[3]
        if any(t.shape[:3] != k.shape[:3] for t in kv_scales) or kv_scales[1].shape != kv_scales[0].shape \
                or q.shape[2] % groups or (q.shape[2] // groups) % 4:
            raise ValueError(f"kv_scales must be two [outer, tokens, Hk, groups] tensors over k's first three dims, "
                             f"groups dividing head_dim into multiples of 4; got {tuple(kv_scales[0].shape)} and "
                             f"{tuple(kv_scales[1].shape)} for k {tuple(k.shape)}")
    if spans.num_rows > q.shape[0] or (spans.block_size == 0 and spans.longest > k.shape[1]):
        raise ValueError(f"the spans need {spans.num_rows} rows and {spans.longest} keys; q has {q.shape[0]} rows, "
                         f"the cache {k.shape[1]} tokens a slot")
    index = spans.index
    _extension().prefill(
        q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), spans.query_start.data_ptr(),
        spans.num_queries.data_ptr(), spans.num_cached.data_ptr(), index.stride(0) if index.dim() == 2 else 1,
        len(spans.query_start), q.shape[1], k.shape[2], q.shape[2], spans.block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), float(scale), num_threads or torch.get_num_threads(),
        q.dtype == torch.bfloat16,
        *((QUANTIZED_KV[kv_dtype], kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), *kv_scales[0].stride()[:3],
           *kv_scales[1].stride()[:3], q.shape[2] // groups) if kv_scales is not None else ()))
    return out
