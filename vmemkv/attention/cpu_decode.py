"""Decode attention on the CPU over the two KV addressings, reading the cache in place: the native
routine of ``native/decode_attention.c`` (the ``vmemkv._decode_attention`` extension), with the
same arguments as the Triton kernels of ``triton_decode``.

SDPA reads a slot's K as a strided view whose consecutive tokens sit a whole model's token stride
apart, one sequence (or one batch of consecutive slots) per call, and block tables need a gather
first. The native routine reads each key row where it lies, once per group of query heads, for
all sequences of the step in one call, on OpenMP threads with the GIL released. float32 and
bfloat16 queries over a cache in their dtype or quantized (int8 / fp8 rows with a float32 scale each,
``memory/quantized_rows.py``, read and scaled in registers); ``unavailable()`` says why it cannot
run here, and the engine then attends with SDPA.
"""

from __future__ import annotations

import functools

import torch

from vmemkv.attention.decode_checks import (QUANTIZED_DTYPES, check_block_tables, check_inputs, check_slot_ids,
                                           check_variant, query_and_output)

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # of q and out
KV_DTYPES = {**DTYPES, torch.int8: 2, torch.float8_e4m3fn: 3}  # of the cache (the last two with scales)
MIN_KEYS_PER_SPLIT = 256  # a split's keys: fewer, and combining them costs more than it saves


@functools.cache
def _extension():
    try:
        from vmemkv import _decode_attention
    except ImportError:
        return None
    return _decode_attention


def unavailable(dtype: torch.dtype | None = None) -> str:
    """"" when the native routine can run (for ``dtype``), else why not."""
    if _extension() is None:
        return ("the native decode attention (vmemkv._decode_attention) is not built: reinstall with a "
                "C compiler that has OpenMP (pip install -e .)")
    if dtype is not None and dtype not in DTYPES:
        return f"the native decode attention reads float32 and bfloat16, not {dtype}"
    return ""


def num_splits_for(batch: int, longest: int, threads: int) -> int:
    """Split each sequence's keys when there are fewer sequences than threads (a work item is one
    sequence, all its heads: a token's rows of every head are read together)."""
    if batch >= threads or longest < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    return max(1, min(-(-threads // batch), longest // MIN_KEYS_PER_SPLIT))


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _check_shared_prefix(shared_prefix, batch: int, window: int | None):
    """The (leaders, lengths) pair as contiguous int32 tensors; the native routine checks the values."""
    if shared_prefix is None:
        return None
    if window:
        raise ValueError("shared_prefix: a sliding window's reads do not start at the prefix")
    leaders, lengths = shared_prefix
    if leaders.shape != (batch,) or lengths.shape != (batch,) or leaders.device.type != "cpu" \
            or lengths.device.type != "cpu":
        raise ValueError(f"shared_prefix must be two [batch] = [{batch}] CPU tensors, got "
                         f"{tuple(leaders.shape)} and {tuple(lengths.shape)}")
    return _as_int32(leaders), _as_int32(lengths)


def _check_new_kv(new_kv, batch: int, k: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The new rows ``[B, Hk, D]`` in the cache's dtype (a quantized cache: q's, quantized by the
    routine) with a contiguous last dim."""
    if new_kv is None:
        return None
    shape, rows = (batch, k.shape[2], k.shape[3]), []
    for t in new_kv:
        if t.shape != shape or t.device.type != "cpu":
            raise ValueError(f"new_kv must be two CPU {list(shape)} tensors, got {tuple(t.shape)} on {t.device}")
        t = t.to(q.dtype if k.dtype in QUANTIZED_DTYPES else k.dtype)
        rows.append(t if t.stride(2) == 1 else t.contiguous())
    return rows[0], rows[1]


class LayerCalls:
    """One step's decode calls, one per layer, checked once. Every layer of a step passes the same
    indices and lengths and (a hybrid model's layer groups aside) tensors of one geometry: the
    first call of each geometry runs the checks and marshals the arguments; the layers after it
    pass their own pointers only (checked every layer, they cost about 2 ms of a 65 ms long-context
    decode step of SmolLM2-135M's 30 layers). Make one per step: the indices it keeps are that
    step's."""

    def __init__(self):
        self._calls: dict[tuple, tuple[list, tuple]] = {}  # geometry -> (arguments, tensors they point into)

    @staticmethod
    def geometry(q, k, v, out, new_kv, index, seq_lens, scale, window, softcap, sinks, check_bounds,
                 num_threads, num_splits, max_seq_len, shared_prefix, kv_scales=None) -> tuple | None:
        """What a call's checks and arguments depend on, besides its tensors' addresses; None for a
        call that converts a tensor (a copy's address changes per call) or has per-layer sinks."""
        if sinks is not None or check_bounds or q.stride(2) != 1:
            return None
        if new_kv is not None and any(t.dtype != (q.dtype if k.dtype in QUANTIZED_DTYPES else k.dtype)
                                      or t.stride(2) != 1 for t in new_kv):
            return None
        return (q.device, q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape, v.stride(), v.dtype,
                None if out is None else (out.shape, out.stride(), out.dtype),
                None if new_kv is None else tuple((t.shape, t.stride()) for t in new_kv),
                id(index), id(seq_lens), None if shared_prefix is None else tuple(map(id, shared_prefix)),
                scale, window, softcap, num_threads, num_splits, max_seq_len,
                None if kv_scales is None else tuple((t.shape, t.stride()) for t in kv_scales))

    def run(self, geometry: tuple, q, k, v, out, new_kv, kv_scales=None) -> torch.Tensor | None:
        """The call of a geometry seen before, with these tensors; None if it is new."""
        known = self._calls.get(geometry)
        if known is None:
            return None
        arguments = list(known[0])
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        arguments[:4] = q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr()
        if new_kv is not None:
            arguments[NEW_KV_AT:NEW_KV_AT + 2] = new_kv[0].data_ptr(), new_kv[1].data_ptr()
        if kv_scales is not None:
            arguments[SCALES_AT:SCALES_AT + 2] = kv_scales[0].data_ptr(), kv_scales[1].data_ptr()
        _extension().decode(*arguments)
        return out

    def remember(self, geometry: tuple, arguments: list, keep: tuple) -> None:
        self._calls[geometry] = arguments, keep


# where the call's arguments (see _run) hold the new rows' and the scales' pointers
NEW_KV_AT, SCALES_AT = 31, 38


def _run(q, k, v, index, index_stride_b, seq_lens, scale, block_size, out, window, softcap, sinks,
         num_threads, num_splits, max_seq_len, shared_prefix, new_kv, calls=None, geometry=None,
         kv_scales=None):
    check_variant(q, window, softcap, sinks)
    shared_prefix = _check_shared_prefix(shared_prefix, q.shape[0], window)
    new_kv = _check_new_kv(new_kv, q.shape[0], k, q)
    if q.device.type != "cpu":
        raise ValueError(f"the native decode attention runs on the CPU, q is on {q.device}")
    if reason := unavailable(q.dtype):
        raise ValueError(reason)
    batch, num_q_heads, head_dim = q.shape
    q, out = query_and_output(q, out)
    if batch == 0:
        return out
    seq_lens = _as_int32(seq_lens)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    threads = num_threads or torch.get_num_threads()
    if num_splits is None:
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = num_splits_for(batch, min(longest, window or longest), threads)
    arguments = [
        q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), seq_lens.data_ptr(),
        sinks.data_ptr() if sinks is not None else 0,
        *((t.data_ptr() for t in shared_prefix) if shared_prefix else (0, 0)), index_stride_b,
        batch, num_q_heads, k.shape[2], head_dim, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        float(scale), window or 0, float(softcap or 0.0), DTYPES[q.dtype], max(1, int(num_splits)), threads,
        *((new_kv[0].data_ptr(), new_kv[1].data_ptr(), new_kv[0].stride(0), new_kv[0].stride(1),
           new_kv[1].stride(0), new_kv[1].stride(1)) if new_kv else (0, 0, 0, 0, 0, 0)),
        KV_DTYPES[k.dtype], *((kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), *kv_scales[0].stride()[:3],
                               *kv_scales[1].stride()[:3], head_dim // kv_scales[0].shape[3])
                              if kv_scales else (0,) * 9)]
    _extension().decode(*arguments)
    if geometry is not None:  # keep the converted indices alive with the pointers into them
        calls.remember(geometry, arguments, (index, seq_lens, shared_prefix))
    return out


def decode_attention_contiguous_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                                    out: torch.Tensor | None = None, window: int | None = None,
                                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                                    check_bounds: bool = False, num_threads: int | None = None,
                                    num_splits: int | None = None, max_seq_len: int | None = None,
                                    shared_prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                                    calls: LayerCalls | None = None,
                                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q`` ``[B, Hq, D]``; ``k_cache``/``v_cache`` strided ``[num_slots, max_tokens, Hk, D]`` views
    (last dim contiguous), in q's dtype, or int8 / float8_e4m3fn with ``kv_scales`` (their float32
    scales ``[num_slots, max_tokens, Hk, groups]``: a value is its byte times its group's scale;
    ``new_kv`` rows are then given in q's dtype and quantized as ``quantized_rows.quantize`` does);
    sequence ``b`` attends to ``k_cache[slot_ids[b], :seq_lens[b]]`` (its last ``window`` keys with
    a window). Returns ``[B, Hq, D]`` in q's dtype (into ``out`` when given).

    The routine trusts its indices, as the engine's are right by construction: ``check_bounds=True``
    checks slot ids and lengths first and raises ``ValueError`` (a wrong one would read outside
    the views). ``num_threads``: default torch's intra-op threads; ``num_splits``: split each
    sequence's keys that many ways (default: when sequences are fewer than threads).

    ``shared_prefix``: ``(leaders, lengths)``, int32 ``[B]`` each, for sequences whose leading keys
    are the same physical rows (a cached prefix): sequence ``b``'s first ``lengths[b]`` keys are
    sequence ``leaders[b]``'s, which are then read once for the whole group (a leader leads
    itself, and every member's length is its leader's; 0 for none). Not with a window.

    ``new_kv``: ``(k, v)``, ``[B, Hk, D]`` each: every sequence's newest token's K and V, written
    at position ``seq_lens[b] - 1`` of its own rows before anything is read (the step's cache
    write and its attention in one call).

    ``calls``: a step's ``LayerCalls``, for calls that repeat one geometry layer after layer."""
    geometry = None if calls is None else LayerCalls.geometry(
        q, k_cache, v_cache, out, new_kv, slot_ids, seq_lens, scale, window, softcap, sinks, check_bounds,
        num_threads, num_splits, max_seq_len, shared_prefix, kv_scales)
    if geometry is not None and (done := calls.run(geometry, q, k_cache, v_cache, out, new_kv,
                                                   kv_scales)) is not None:
        return done
    check_inputs(q, k_cache, v_cache, seq_lens, ("k_cache", "v_cache"), out, kv_scales)
    check_slot_ids(slot_ids, q, seq_lens, k_cache, check_bounds)
    return _run(q, k_cache, v_cache, _as_int32(slot_ids), 1, seq_lens, scale, 0, out, window, softcap,
                sinks, num_threads, num_splits, max_seq_len, shared_prefix, new_kv, calls, geometry, kv_scales)


def decode_attention_paged_cpu(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               out: torch.Tensor | None = None, window: int | None = None,
                               softcap: float | None = None, sinks: torch.Tensor | None = None,
                               check_bounds: bool = False, num_threads: int | None = None,
                               num_splits: int | None = None, max_seq_len: int | None = None,
                               shared_prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                               calls: LayerCalls | None = None,
                               kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Block tables: ``k_blocks``/``v_blocks`` strided ``[num_blocks, block_size, Hk, D]``,
    ``block_tables`` ``[B, max_blocks]``; token ``t`` of sequence ``b`` is
    ``k_blocks[block_tables[b, t // block_size], t % block_size]``; entries behind a window or past
    a length are never read. Quantized blocks come with ``kv_scales`` ``[num_blocks, block_size, Hk,
    groups]``. Other arguments as ``decode_attention_contiguous_cpu``."""
    geometry = None if calls is None else LayerCalls.geometry(
        q, k_blocks, v_blocks, out, new_kv, block_tables, seq_lens, scale, window, softcap, sinks, check_bounds,
        num_threads, num_splits, max_seq_len, shared_prefix, kv_scales)
    if geometry is not None and (done := calls.run(geometry, q, k_blocks, v_blocks, out, new_kv,
                                                   kv_scales)) is not None:
        return done
    check_inputs(q, k_blocks, v_blocks, seq_lens, ("k_blocks", "v_blocks"), out, kv_scales)
    block_tables = check_block_tables(block_tables, q, seq_lens, k_blocks, window, check_bounds)
    block_size = k_blocks.shape[1]
    tables = _as_int32(block_tables)
    return _run(q, k_blocks, v_blocks, tables, tables.stride(0), seq_lens, scale, block_size, out, window,
                softcap, sinks, num_threads, num_splits, max_seq_len, shared_prefix, new_kv, calls, geometry,
                kv_scales)
