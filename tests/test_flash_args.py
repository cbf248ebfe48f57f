"""FlashAttention over slots and block tables, everything but the kernel, on a CPU.

The argument builders (slots -> one uniformly strided K/V tensor, ``cu_seqlens_q``,
``cu_seqlens_k = slot * rows_per_slot``, ``seqused_k``; block tables) feed a pure-torch reference
of FlashAttention-2's documented varlen semantics, and must reproduce the per-sequence SDPA path in
float64: a prefill, a chunked prefill, two decodes, GQA 4:1, packed out of slot order. The attention
classes the engine runs on CUDA are run here too, with the reference plugged in as their kernel.
"""

from __future__ import annotations

import pytest
import torch

from flash_cases import case_manager, history_attention, mixed_step
from vmemkv.attention.flash import FlashBlockTableAttention, FlashSlotAttention
from vmemkv.attention.flash_args import (FlashUnsupportedError, block_varlen_args, fa2_block_size_supported,
                                         fill_released, flatten_slots, slot_geometry, slot_rows, slot_varlen_args,
                                         slot_varlen_arguments)
from vmemkv.attention.flash_kernels import FlashKernel
from vmemkv.attention.flash_reference import reference_varlen, varlen_attention_reference
from vmemkv.attention.packed import SequenceSpan
from vmemkv.cache.request import RELEASED

REFERENCE_KERNEL = FlashKernel("reference", reference_varlen)
SCALE = 0.3  # not head_dim ** -0.5: the scale must travel through


@pytest.fixture(params=["token_major", "per_layer"])
def vmem_manager(request):
    yield from case_manager(tokens_per_page=8, layout=request.param)


@pytest.fixture(params=[8, 256])
def paged_manager(request):
    yield from case_manager(tokens_per_page=request.param, num_blocks=40 if request.param == 8 else 8,
                            kv_backend="paged")


def sdpa_step(manager, spans, query, key, value, layer=1):
    """The existing per-sequence SDPA path (it writes the step's new K/V first)."""
    attention = history_attention(manager, spans, "cpu")
    return attention(layer, query, key, value, SCALE)


def test_builder_and_reference_reproduce_sdpa_over_slots(vmem_manager):
    spans, query, key, value = mixed_step(vmem_manager, torch.float64)
    expected = sdpa_step(vmem_manager, spans, query, key, value)  # [1, T, Hq, D]; writes K/V
    k_flat, v_flat, args = slot_varlen_arguments(spans, *vmem_manager.kv_views(1))
    host = args.tensors()
    rows = slot_rows(vmem_manager.kv_views(1)[0])
    assert rows >= vmem_manager.config.max_model_len  # padded slots are fine: the stride says
    assert args.cu_seqlens_k[:-1] == sorted(s.slot * rows for s in spans)
    assert args.cu_seqlens_k[-1] == k_flat.shape[0]
    assert sorted(args.seqused_k) == sorted(s.length for s in spans)
    assert args.query_rows is not None  # packed out of slot order
    q = query[0].transpose(0, 1).index_select(0, host["query_rows"])
    out = varlen_attention_reference(q, k_flat, v_flat, host["cu_seqlens_q"], host["cu_seqlens_k"], SCALE,
                                     seqused_k=host["seqused_k"])
    unsorted = torch.empty_like(out).index_copy_(0, host["query_rows"], out)
    torch.testing.assert_close(unsorted, expected[0], rtol=1e-10, atol=1e-10)


def test_flash_slot_attention_with_reference_kernel_matches_sdpa(vmem_manager):
    spans, query, key, value = mixed_step(vmem_manager, torch.float64)
    expected = sdpa_step(vmem_manager, spans, query, key, value)
    rows = slot_geometry(*vmem_manager.kv_views(1))
    num_rows = flatten_slots(vmem_manager.kv_views(1)[0], rows).shape[0]
    attention = FlashSlotAttention(spans, vmem_manager.kv_views, torch.device("cpu"), REFERENCE_KERNEL,
                                   rows, num_rows)
    out = attention(1, query, key, value, SCALE)  # writes the same K/V again, then one call
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_builder_and_reference_reproduce_sdpa_over_block_tables(paged_manager):
    spans, query, key, value = mixed_step(paged_manager, torch.float64)
    expected = sdpa_step(paged_manager, spans, query, key, value)
    block_size = paged_manager.tokens_per_page
    args = block_varlen_args(spans, block_size)
    host = args.tensors()
    assert args.cu_seqlens_k[-1] == sum(s.length for s in spans)
    assert host["block_table"].shape == (len(spans), max(-(-s.length // block_size) for s in spans))
    k_blocks, v_blocks = paged_manager.block_views(1)
    q = query[0].transpose(0, 1)
    out = varlen_attention_reference(q, k_blocks, v_blocks, host["cu_seqlens_q"], host["cu_seqlens_k"], SCALE,
                                     seqused_k=host["seqused_k"], block_table=host["block_table"])
    torch.testing.assert_close(out, expected[0], rtol=1e-10, atol=1e-10)
    attention = FlashBlockTableAttention(spans, paged_manager.block_views, block_size, torch.device("cpu"),
                                         REFERENCE_KERNEL)
    torch.testing.assert_close(attention(1, query, key, value, SCALE), expected, rtol=1e-10, atol=1e-10)
    assert "read_block_ids" not in attention.__dict__  # the kernel reads the tables: nothing staged
    # a layer the kernel cannot run (sinks of -inf change nothing) takes per-sequence SDPA reads,
    # whose block ids are uploaded then
    no_sinks = torch.full((query.shape[1],), float("-inf"), dtype=query.dtype)
    torch.testing.assert_close(attention(1, query, key, value, SCALE, sinks=no_sinks), expected,
                               rtol=1e-10, atol=1e-10)
    assert attention.read_block_ids.tolist() == [b for s in spans for b in s.block_table[: -(-s.length // block_size)]]
    assert fa2_block_size_supported(block_size) == (block_size == 256)


def test_released_blocks_point_at_the_first_held_block_for_flash_only():
    """FlashAttention may load a tile before a window's start: its table points the blocks released
    behind the window at the first held block (written, finite; masked). The spans keep RELEASED."""
    assert fill_released((RELEASED, RELEASED, 7, 9)) == [7, 7, 7, 9]
    assert fill_released((3, 4)) == [3, 4] and fill_released(()) == []
    assert fill_released((RELEASED,)) == [RELEASED]  # nothing held: nothing to point at
    spans = [SequenceSpan(0, 0, 1, 40, (RELEASED, RELEASED, 5, 6, 8, 2)), SequenceSpan(1, 1, 1, 3, (4,))]
    args = block_varlen_args(spans, 8)
    assert args.block_table == [[5, 5, 5, 6, 8, 2], [4, 0, 0, 0, 0, 0]]
    assert spans[0].block_table[:2] == (RELEASED, RELEASED)


def test_fa2_block_sizes():
    assert [fa2_block_size_supported(n) for n in (16, 128, 256, 512, 768, 0)] == [
        False, False, True, True, True, False]


# --- geometry refusals ---------------------------------------------------------------------------

def strided(shape, strides, device="meta"):
    """A view with these strides over storage that is never touched (meta: no memory at all)."""
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    return torch.empty(extent, device=device).as_strided(shape, strides)


def test_uniform_slot_views_flatten_to_rows():
    store = torch.arange(3 * 8 * 2 * 4, dtype=torch.float32).view(3, 8, 2, 4)
    view = store[:, :6]  # 6 tokens a slot, 8 rows of stride apart
    assert slot_rows(view) == 8
    flat = flatten_slots(view)
    assert flat.shape == (2 * 8 + 6, 2, 4)
    assert torch.equal(flat[8 * 2 + 5], store[2, 5]) and torch.equal(flat[8 + 3], store[1, 3])


@pytest.mark.parametrize("shape,strides,message", [
    ((3, 5, 2, 4), (53, 10, 4, 1), "not a multiple"),  # slot stride not whole token rows
    ((3, 5, 2, 4), (30, 10, 4, 1), "overlap"),  # slots overlap
    ((3, 5, 2, 4), (80, 16, 8, 2), "contiguous"),  # last dim strided
])
def test_non_uniform_slot_views_are_refused(shape, strides, message):
    with pytest.raises(FlashUnsupportedError, match=message):
        slot_rows(strided(shape, strides))


def test_int32_row_offsets_are_refused():
    # 256 slots x 2^24 tokens: cu_seqlens_k (int32) cannot hold the last slot's offset.
    token = 8 * 128
    view = strided((256, 1 << 24, 8, 128), ((1 << 24) * token, token, 128, 1))
    with pytest.raises(FlashUnsupportedError, match="int32"):
        slot_geometry(view, view)


def test_k_and_v_views_must_agree():
    k = strided((3, 5, 2, 4), (80, 16, 4, 1))
    v = strided((3, 5, 2, 4), (96, 16, 4, 1))
    with pytest.raises(FlashUnsupportedError, match="differ"):
        slot_geometry(k, v)


def test_slot_args_order_by_slot_and_keep_identity_when_sorted():
    spans = [SequenceSpan(0, 0, 3, 0), SequenceSpan(2, 3, 1, 5)]
    args = slot_varlen_args(spans, 10, 26)
    assert args.query_rows is None and args.order == [0, 1]
    assert args.cu_seqlens_q == [0, 3, 4] and args.cu_seqlens_k == [0, 20, 26] and args.seqused_k == [3, 6]
    assert (args.max_seqlen_q, args.max_seqlen_k) == (3, 6)
    swapped = slot_varlen_args([SequenceSpan(2, 0, 1, 5), SequenceSpan(0, 1, 3, 0)], 10, 26)
    assert swapped.order == [1, 0] and swapped.query_rows == [1, 2, 3, 0]
    with pytest.raises(FlashUnsupportedError, match="share a slot"):
        slot_varlen_args([SequenceSpan(1, 0, 1, 0), SequenceSpan(1, 1, 1, 0)], 10, 26)
    with pytest.raises(FlashUnsupportedError, match="past its slot"):
        slot_varlen_args([SequenceSpan(0, 0, 1, 10)], 10, 26)


def test_reference_causal_alignment_is_bottom_right():
    # 2 queries after 3 cached keys: query 0 sees keys 0..3, query 1 sees all 5.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    out = varlen_attention_reference(q, k, v, torch.tensor([0, 2]), torch.tensor([0, 5]), 0.5)
    for row, visible in ((0, 4), (1, 5)):
        weights = torch.softmax((q[row, 0].double() @ k[:visible, 0].double().T) * 0.5, dim=-1)
        torch.testing.assert_close(out[row, 0], weights @ v[:visible, 0].double())
    # more queries than keys: the first rows see nothing and give zeros
    out = varlen_attention_reference(torch.randn(3, 1, 4), k[:2], v[:2], torch.tensor([0, 3]),
                                     torch.tensor([0, 2]), 0.5)
    assert torch.equal(out[0], torch.zeros(1, 4, dtype=torch.float64))


def test_decode_only_steps_can_take_the_kvcache_call(vmem_manager, monkeypatch):
    """flash-attn's ``flash_attn_with_kvcache(cache_batch_idx=slots)`` path, with the reference in
    the kernel's place: it must get the slot views, each sequence's slot and length, in packed
    order."""
    from vmemkv.attention import flash as flash_module
    spans, query, key, value = mixed_step(vmem_manager, torch.float64)
    decodes = [s for s in spans if s.num_queries == 1]
    rows = [s.query_start for s in decodes]
    decodes = [SequenceSpan(s.slot, i, 1, s.num_cached) for i, s in enumerate(decodes)]
    query, key, value = (t[:, :, rows] for t in (query, key, value))
    expected = sdpa_step(vmem_manager, decodes, query, key, value)
    calls = []

    def fake_kvcache_decode(q, k_view, v_view, lengths, slots, max_length, scale, window=None, softcap=None):
        calls.append((slots.tolist(), lengths.tolist(), max_length))
        flat_k, flat_v = flatten_slots(k_view), flatten_slots(v_view)
        per_slot = slot_rows(k_view)
        cu_k = torch.tensor([s * per_slot for s in slots.tolist()] + [flat_k.shape[0]], dtype=torch.int32)
        return varlen_attention_reference(q, flat_k, flat_v, torch.arange(len(q) + 1, dtype=torch.int32), cu_k,
                                          scale, seqused_k=lengths)

    monkeypatch.setattr(flash_module, "package_kvcache_decode", fake_kvcache_decode)
    kernel = FlashKernel("package", reference_varlen, kvcache_decode=True)
    per_slot = slot_geometry(*vmem_manager.kv_views(1))
    num_rows = flatten_slots(vmem_manager.kv_views(1)[0], per_slot).shape[0]
    attention = FlashSlotAttention(decodes, vmem_manager.kv_views, torch.device("cpu"), kernel, per_slot, num_rows)
    assert attention.kvcache_decode
    torch.testing.assert_close(attention(1, query, key, value, SCALE), expected, rtol=1e-10, atol=1e-10)
    assert calls == [([s.slot for s in decodes], [s.length for s in decodes], max(s.length for s in decodes))]
    mixed = FlashSlotAttention(spans, vmem_manager.kv_views, torch.device("cpu"), kernel, per_slot, num_rows)
    assert not mixed.kvcache_decode  # a step with a prefill takes the varlen call
