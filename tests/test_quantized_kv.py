"""Quantized live KV (``kv_cache_dtype`` "int8" / "fp8"): the row format, the layout's bytes, the
native decode routine against its float reference, a step's attention against SDPA over the
dequantized rows, the engine end to end, and the refusals. The state machine walks quantized
pages (scales carried by every copy) in test_manager_state_machine.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vmemkv import CacheConfig, ConfigError, KVCacheManager
from vmemkv.attention.cpu_decode import _extension, decode_attention_contiguous_cpu, unavailable
from vmemkv.attention.cpu_prefill import PrefillSpans, prefill_attention_cpu
from vmemkv.attention.cpu_prefill import unavailable as prefill_unavailable
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.addressing import slot_attention
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.memory.quantized_rows import QMAX, dequantize, groups_per_row, quantize

from conftest import assert_no_leaks, check_and_close, tiny_config
from test_state_engine import FALCON_H1, STATE_MIXERS_ROUTED

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
native = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")


# --- the row format --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FORMATS.values(), ids=FORMATS.keys())
def test_a_row_comes_back_within_its_format_error(dtype):
    rows = torch.randn(64, 4, 96) * torch.logspace(-3, 3, 64)[:, None, None]
    rows[0, 0] = 0  # an all-zero row: scale 1, values 0
    values, scales = quantize(rows, dtype)
    assert values.dtype == dtype and scales.shape == (64, 4, 3) and scales.dtype == torch.float32
    back = dequantize(values, scales, torch.float32)
    amax = rows.unflatten(-1, (3, 32)).abs().amax(-1, keepdim=True).repeat_interleave(32, -2).flatten(-2)
    error = (back - rows).abs()
    if dtype == torch.int8:  # rounding to the nearest of 255 levels: half a step
        assert (error <= amax / 127 / 2 * 1.0001 + 1e-12).all()
    else:  # e4m3: 3 mantissa bits, half an ulp of 2^-3 relative; subnormals below 2^-6 x scale
        assert (error <= torch.maximum(rows.abs() * 2 ** -4, amax / 448 * 2 ** -9) * 1.0001 + 1e-12).all()
    assert torch.equal(back[0, 0], torch.zeros(96))
    edges = values.float().unflatten(-1, (3, 32)).abs().amax(-1)
    assert (edges == QMAX[dtype])[1:].all()  # each group's largest value hits the edge


# --- the layout -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_quantized_bytes_per_token_are_about_half_of_bfloat16(kv_cache_dtype):
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64): 768 B a token and layer in bfloat16,
    384 of values and 48 of scales (one per 32 values) quantized, each row of 216 padded to 224 (a
    layer's K and V then fill 7 whole cache lines)."""
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=4, max_num_seqs=1, max_model_len=64)
    bf16 = CacheConfig(**shape, dtype=torch.bfloat16).make_layout()
    quantized = CacheConfig(**shape, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype).make_layout()
    assert bf16.kv_bytes_per_token_per_layer == 768
    assert quantized.row_block_bytes == 3 * 64 + 3 * 2 * 4 and quantized.row_stride_bytes == 224
    assert quantized.kv_bytes_per_token_per_layer == 2 * 224
    assert quantized.row_data_bytes == 30 * 448 and quantized.scaled and not bf16.scaled
    assert groups_per_row(64) == 2 and groups_per_row(24) == 1  # a row not of 32s: one scale


@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_values_and_scales_of_every_row_live_apart(layout, kv_cache_dtype):
    """Every layer's K and V values and scales written through the views read back after all were
    written: no view overlaps another (nor the padding's bytes another row's)."""
    manager = KVCacheManager(tiny_config(kv_cache_dtype=kv_cache_dtype, dtype=torch.float32, layout=layout))
    manager.admit("a", list(range(10)))
    manager.allocate("a", 10)
    slot = manager.slot_of("a")
    rows = {}
    for layer in range(2):
        for kv, (values, scales) in enumerate(zip(manager.kv_views(layer), manager.kv_scale_views(layer))):
            rows[layer, kv] = quantize(torch.randn(10, 2, 64) * (1 + layer + 2 * kv), values.dtype)
            values[slot, :10], scales[slot, :10] = rows[layer, kv]
    for layer in range(2):
        for kv, (values, scales) in enumerate(zip(manager.kv_views(layer), manager.kv_scale_views(layer))):
            assert torch.equal(values[slot, :10].view(torch.uint8), rows[layer, kv][0].view(torch.uint8))
            assert torch.equal(scales[slot, :10], rows[layer, kv][1])
        del values, scales
    manager.free("a")
    check_and_close([manager])


@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_block_tensors_address_the_bytes_and_scales_the_slots_do(layout, kv_cache_dtype):
    """Values and scales written through the slot views read back through the block tensors
    (``block_views``, ``block_scale_views``) at each token's block and offset: two mappings of one
    set of bytes, for the block-table baseline."""
    manager = KVCacheManager(tiny_config(kv_cache_dtype=kv_cache_dtype, dtype=torch.float32, layout=layout))
    manager.admit("a", list(range(11)))
    manager.allocate("a", 10)  # 21 positions, over two pages of 16 tokens
    slot, table, size = manager.slot_of("a"), manager.block_table("a"), manager.tokens_per_page
    blocks, offsets = [table[t // size] for t in range(21)], [t % size for t in range(21)]
    for layer in range(2):
        slot_rows = zip(manager.kv_views(layer), manager.kv_scale_views(layer))
        block_rows = zip(manager.block_views(layer), manager.block_scale_views(layer))
        for kv, ((values, scales), (value_blocks, scale_blocks)) in enumerate(zip(slot_rows, block_rows)):
            values[slot, :21], scales[slot, :21] = quantize(torch.randn(21, 2, 64) * (1 + layer + 2 * kv),
                                                            values.dtype)
            assert torch.equal(value_blocks[blocks, offsets].view(torch.uint8), values[slot, :21].view(torch.uint8))
            assert torch.equal(scale_blocks[blocks, offsets], scales[slot, :21])
        del values, scales, value_blocks, scale_blocks, slot_rows, block_rows
    manager.free("a")
    check_and_close([manager])


def test_a_plain_layout_has_no_scale_views():
    manager = KVCacheManager(tiny_config())
    assert manager.kv_scale_views(0) is None and manager.block_scale_views(0) is None
    assert not manager.layout.scaled
    check_and_close([manager])


# --- the native decode routine ------------------------------------------------------------------------

def random_rows(shape, dtype, generator):
    """Random K and V of ``shape`` quantized to ``dtype``: their bytes and scales, and the float32
    values those stand for."""
    (kq, ks), (vq, vs) = (quantize(torch.randn(shape, generator=generator), dtype) for _ in range(2))
    return kq, ks, vq, vs, dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)


def int16_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The query as the integer dot products read it: ``q * scale`` rounded to steps of its head's
    largest value / 32767 (ties to even), then unscaled (``scale`` a power of two: exact)."""
    scaled = q.float() * scale
    largest = scaled.abs().amax(-1, keepdim=True)
    # a float32 division, as C's (a number over a tensor is a reciprocal times the number in torch)
    inverse = torch.where(largest > 0, torch.full_like(largest, 32767.0) / largest, torch.zeros_like(largest))
    return torch.round(scaled * inverse) * (largest / 32767) / scale


@native
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "narrow"])
@pytest.mark.parametrize("head_dim", [64, 128, 48, 24])
@pytest.mark.parametrize("dtype", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_reads_quantized_rows_as_their_float_reference(grouped, head_dim, dtype, q_dtype):
    """The routine on int8 / fp8 rows and their scales gives what it gives on the same rows
    dequantized to float32: splits, a window and shared prefixes too. Both kernels: the grouped
    one (AVX-512, bytes widened in registers, scales on scores and weights) and the narrow one;
    on rows of 64-value blocks the grouped one's dot products too: int8 (VNNI), whose reference
    reads the query rounded to int16 as they do, and fp8 under a bfloat16 query (AVX-512 BF16),
    whose V rows are weighted in bfloat16 (8-bit weights, as FlashAttention's): the float result
    moves by ~1e-4, which the bfloat16 output's rounding can turn into one step of it (rtol)."""
    extension = _extension()
    if grouped and not extension.grouped_heads():
        pytest.skip("the grouped kernel needs AVX-512, which this CPU lacks")
    switch = extension.integer_dot_products if dtype == torch.int8 else extension.bf16_dot_products
    dot_products = [False]
    if grouped and head_dim % 64 == 0 and (dtype == torch.int8 or q_dtype == torch.bfloat16):
        if not switch():
            pytest.skip("the grouped kernel's dot products need AVX-512 VNNI / BF16, which this CPU lacks")
        dot_products.append(True)
    grouped_before, dots_before = extension.grouped_heads(grouped), switch()
    atol = 2e-3 if q_dtype == torch.bfloat16 else 2e-6
    try:
        for dots in dot_products:
            switch(dots)
            rtol = 2 ** -7 if dots and dtype == torch.float8_e4m3fn else 0
            int16 = dots and dtype == torch.int8
            reference_query = (lambda q: int16_query(q, 0.125)) if int16 else (lambda q: q.float())
            generator = torch.Generator().manual_seed(head_dim)
            kq, ks, vq, vs, kd, vd = random_rows((5, 700, 2, head_dim), dtype, generator)
            q = torch.randn(3, 6, head_dim, generator=generator).to(q_dtype)
            slots, lens = torch.tensor([4, 0, 2]), torch.tensor([700, 33, 300], dtype=torch.int32)
            for options in (dict(num_splits=1), dict(num_splits=3), dict(window=100)):
                expected = decode_attention_contiguous_cpu(reference_query(q), kd, vd, slots, lens, 0.125, **options)
                got = decode_attention_contiguous_cpu(q, kq, vq, slots, lens, 0.125, kv_scales=(ks, vs), **options)
                torch.testing.assert_close(got.float(), expected.to(q_dtype).float(), atol=atol, rtol=rtol)
            # slots 0 and 1 share their first 256 rows: read once for both
            kq[1, :256], ks[1, :256], vq[1, :256], vs[1, :256] = kq[0, :256], ks[0, :256], vq[0, :256], vs[0, :256]
            kd, vd = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
            slots, lens = torch.tensor([0, 1]), torch.tensor([600, 400], dtype=torch.int32)
            shared = (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([256, 256], dtype=torch.int32))
            expected = decode_attention_contiguous_cpu(reference_query(q[:2]), kd, vd, slots, lens, 0.125)
            got = decode_attention_contiguous_cpu(q[:2], kq, vq, slots, lens, 0.125, kv_scales=(ks, vs),
                                                  shared_prefix=shared)
            torch.testing.assert_close(got.float(), expected.to(q_dtype).float(), atol=atol, rtol=rtol)
    finally:
        extension.grouped_heads(grouped_before)
        switch(dots_before)


@native
@pytest.mark.parametrize("dtype", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_quantizes_the_new_rows_as_torch_does(dtype, q_dtype):
    """``new_kv`` into a quantized cache: the routine writes the very bytes and scales that
    ``quantized_rows.quantize`` gives (ties, subnormals and a zero row included), then reads them."""
    generator = torch.Generator().manual_seed(3)
    k = torch.zeros(3, 16, 2, 64, dtype=dtype)
    v = torch.zeros(3, 16, 2, 64, dtype=dtype)
    scales = (torch.zeros(3, 16, 2, 2), torch.zeros(3, 16, 2, 2))
    new = [torch.randn(3, 2, 64, generator=generator) * torch.logspace(-4, 4, 64) for _ in (0, 1)]
    new[0][1, 0] = 0  # a zero row
    new[1][2, 1] = 0
    new[1][2, 1, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])  # scale 1: int8 ties, rounded to even
    new = [t.to(q_dtype) for t in new]
    q = torch.randn(3, 4, 64, generator=generator).to(q_dtype)
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([5, 9, 16], dtype=torch.int32)
    decode_attention_contiguous_cpu(q, k, v, slots, lens, 0.125, kv_scales=scales, new_kv=tuple(new))
    for cache, cache_scales, rows in ((k, scales[0], new[0]), (v, scales[1], new[1])):
        expected_values, expected_scales = quantize(rows, dtype)
        at = (slots, lens.long() - 1)
        assert torch.equal(cache[at].view(torch.uint8), expected_values.view(torch.uint8))
        assert torch.equal(cache_scales[at], expected_scales)


@native
def test_native_decode_refuses_what_quantized_rows_cannot_take():
    k = torch.zeros(2, 8, 1, 64, dtype=torch.int8)
    scales = torch.ones(2, 8, 1, 2)
    q, lens, slots = torch.zeros(1, 2, 64), torch.tensor([4], dtype=torch.int32), torch.tensor([0])
    with pytest.raises(ValueError, match="scales of k_cache must be float32"):
        decode_attention_contiguous_cpu(q, k, k, slots, lens, 1.0, kv_scales=(scales[:, :4], scales))
    with pytest.raises(ValueError, match="must share a dtype"):  # int8 rows without their scales
        decode_attention_contiguous_cpu(q, k, k, slots, lens, 1.0)


prefill_native = pytest.mark.skipif(bool(prefill_unavailable()), reason=prefill_unavailable() or "")


@prefill_native
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("dtype", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_reads_quantized_rows_as_their_float_reference(head_dim, dtype, q_dtype):
    """The prefill routine on int8 / fp8 rows and their scales (32 values a scale; a whole row at
    head_dim 24) gives what it gives on the same rows dequantized to float32, bit for bit: each
    value is its byte times its scale, as ``dequantize`` makes it. A chunk after cached tokens and
    a whole prompt, in one call."""
    generator = torch.Generator().manual_seed(head_dim)
    kq, ks, vq, vs, kd, vd = random_rows((3, 300, 2, head_dim), dtype, generator)
    q = torch.randn(50, 6, head_dim, generator=generator).to(q_dtype)
    spans = PrefillSpans([0, 20], [20, 30], [100, 0], [2, 0])
    expected = prefill_attention_cpu(q.float(), kd, vd, spans, 0.125, torch.zeros(q.shape))
    got = prefill_attention_cpu(q, kq, vq, spans, 0.125, torch.zeros_like(q), kv_scales=(ks, vs))
    assert torch.equal(got, expected.to(q_dtype))
    with pytest.raises(ValueError, match="kv_scales must be two"):
        prefill_attention_cpu(q, kq, vq, spans, 0.125, torch.zeros_like(q), kv_scales=(ks[:, :, :1], vs))
    with pytest.raises(ValueError, match="kv_scales go with int8"):  # rows of q's dtype have no scales
        prefill_attention_cpu(q.float(), kd, vd, spans, 0.125, torch.zeros(q.shape), kv_scales=(ks, vs))


# --- a step's attention over a manager's quantized slots ---------------------------------------------------

@pytest.mark.parametrize("attention", ["native", "sdpa"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_step_attends_the_rows_it_wrote_quantized(attention, kv_cache_dtype):
    """``slot_attention`` over a quantized manager: a prompt chunk (the native prefill routine
    reading the bytes, or SDPA over its dequantized rows) and then a decode step (the native routine, or SDPA) give SDPA's attention over the
    dequantized K/V: what was written is what is read, scales and all."""
    from vmemkv.attention import SequenceSpan

    if attention == "native" and unavailable():
        pytest.skip(unavailable())
    manager = KVCacheManager(tiny_config(kv_cache_dtype=kv_cache_dtype, dtype=torch.float32, max_model_len=40))
    make_step = slot_attention(manager, num_query_heads=4, attention=attention)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, 13, 64, generator=generator) for heads in (4, 2, 2))
    manager.admit("a", list(range(13)))
    manager.allocate("a", 13)
    slot = manager.slot_of("a")
    dtype = FORMATS[kv_cache_dtype]

    def reference(count, query=q):  # SDPA over K/V as quantized and dequantized, the last `count` queries
        kd = dequantize(*quantize(k, dtype), torch.float32)
        vd = dequantize(*quantize(v, dtype), torch.float32)
        full = F.scaled_dot_product_attention(query, kd, vd, is_causal=True, enable_gqa=True)
        return full[:, :, -count:].transpose(1, 2)

    prefill = make_step([SequenceSpan(slot, 0, 12, 0)])(0, q[:, :, :12], k[:, :, :12], v[:, :, :12], None)
    torch.testing.assert_close(prefill, reference(13)[:, :12], atol=1e-5, rtol=0)
    manager.commit("a", 12)
    decode = make_step([SequenceSpan(slot, 0, 1, 12)])(0, q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], None)
    dot_products = attention == "native" and dtype == torch.int8 and _extension().integer_dot_products()
    query = int16_query(q, 64 ** -0.5) if dot_products else q  # the native int8 scores' query
    torch.testing.assert_close(decode, reference(1, query), atol=1e-5, rtol=0)
    del make_step
    manager.free("a")
    check_and_close([manager])


# --- the engine ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype,model", [
    ("int8", "tiny-llama"), ("fp8", "tiny-llama"), ("int8", "tiny-mistral"), ("int8", "tiny-gemma2"),
    pytest.param("fp8", "tiny-qwen3-next", marks=STATE_MIXERS_ROUTED),  # skipped where transformers'
    pytest.param("int8", "tiny-falcon-h1", marks=FALCON_H1),  # mixers take their state otherwise
    ("int8", "tiny-deepseek-v3"), ("fp8", "tiny-minicpm3")])
def test_the_engine_runs_on_quantized_kv_and_reports_its_bytes(kv_cache_dtype, model):
    """Full attention, a sliding window (released behind it), local and global layer groups,
    recurrent state beside quantized attention layers (the state keeps its own dtypes), and MLA's
    latent rows (one a token and layer)."""
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=4, max_model_len=128,
                                    kv_cache_dtype=kv_cache_dtype, swap_space_bytes=16 << 20))
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
    assert all(len(final[str(i)].outputs[0].token_ids) == 12 for i in range(4))
    stats = engine.stats()
    layout = engine.manager.layout
    assert stats["kv_cache_dtype"] == kv_cache_dtype
    row = layout.num_kv_heads * (layout.head_dim + 4 * groups_per_row(layout.head_dim))
    assert stats["kv_bytes_per_token_per_layer"] == layout.rows_per_layer * (-(-row // 32) * 32)  # padded to 32 B
    assert_no_leaks(engine.manager)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_latent_rows_are_written_quantized_and_attended_as_their_float_reference(kv_cache_dtype):
    """MLA's latent rows (one a token and layer) in int8 / fp8 with their scales: a prompt chunk
    and a decode step attend what they wrote, the rows dequantized, as ``attend_latent`` does over
    the same rows quantized and dequantized by hand."""
    from vmemkv.attention import SequenceSpan
    from vmemkv.attention.latent import LatentAttention, attend_latent
    from vmemkv.attention.variants import causal_window_mask

    manager = KVCacheManager(tiny_config(kv_cache_dtype=kv_cache_dtype, dtype=torch.float32, latent=True,
                                         num_kv_heads=1, max_model_len=40))
    manager.admit("a", list(range(12)))
    manager.allocate("a", 1)
    slot, generator = manager.slot_of("a"), torch.Generator().manual_seed(5)
    latent = torch.randn(1, 1, 13, 64, generator=generator) * torch.logspace(-1, 1, 64)
    query = torch.randn(1, 4, 13, 64, generator=generator)
    stored = dequantize(*quantize(latent[0, 0], FORMATS[kv_cache_dtype]), torch.float32)  # [13, 64]
    views = manager.views()
    for span, tokens in ((SequenceSpan(slot, 0, 12, 0), slice(0, 12)), (SequenceSpan(slot, 0, 1, 12), slice(12, 13))):
        attention = LatentAttention([span], views.kv_views, "cpu", views.kv_scale_views)
        got = attention(0, query[:, :, tokens], latent[:, :, tokens], 0.125, 48)
        mask = causal_window_mask(span.num_cached, span.num_queries, 0, None, "cpu") if span.num_queries > 1 else None
        expected = attend_latent(query[0, :, tokens], stored[:tokens.stop], 0.125, 48, mask).transpose(0, 1)
        torch.testing.assert_close(got[0], expected, atol=1e-6, rtol=0)
    assert manager.kv_scale_views(0)[0].shape[-1] == groups_per_row(64)
    del views, attention
    manager.free("a")
    check_and_close([manager])


@pytest.mark.parametrize("attention", ["native", "sdpa"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_block_tables_read_the_quantized_rows_slots_read(kv_cache_dtype, attention):
    """kv_backend='paged' over int8 / fp8 rows: written and read through block tables (the native
    routines read bytes and scales where they lie; SDPA the rows gathered and dequantized), the
    greedy tokens are vmem's, with a shared prefix cached and a pool small enough that requests are
    swapped out and back in."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(3)]
    prompts.append(prompts[2][:24] + [5, 6, 7])  # a cached prefix: blocks shared, scales and all
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("vmem", "paged"):
        engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=128, attention=attention,
                                        kv_cache_dtype=kv_cache_dtype, kv_backend=backend, num_blocks=9,
                                        swap_space_bytes=16 << 20))
        final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
        tokens[backend] = [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]
        stats = engine.stats()
        assert stats["kv_cache_dtype"] == kv_cache_dtype
        assert stats["preemptions_swap"] > 0 and stats["prefix_hit_tokens"] > 0  # swapped out and in, a hit
        assert_no_leaks(engine.manager)
    assert tokens["paged"] == tokens["vmem"]
    assert all(len(t) == 12 for t in tokens["vmem"])


@pytest.mark.slow
def test_the_real_model_reads_the_same_int8_rows_with_both_kernels(real_engine_model):
    """SmolLM2-135M with int8 KV: the native decode routine and SDPA over the dequantized rows
    read the same bytes, so greedy tokens agree; and most answers match the exact float32 run."""
    from test_real_model import make_engine, run

    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 563, 13773, 25, 2707, 28, 12, 1239],
               [1, 7151, 2122, 253, 655, 28, 281, 253, 2491, 1647, 2664], [1, 378, 1115, 4062, 282]]
    tokens = {}
    for name, options in {"exact": {}, "native": dict(kv_cache_dtype="int8", attention="native"),
                          "sdpa": dict(kv_cache_dtype="int8", attention="sdpa")}.items():
        engine = make_engine(real_engine_model, dtype="float32", **options)
        tokens[name] = run(engine, prompts)
        assert_no_leaks(engine.manager)
    assert tokens["native"] == tokens["sdpa"]
    assert sum(a == b for a, b in zip(tokens["native"], tokens["exact"])) >= 2


@pytest.mark.parametrize("options,match", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be"),
    (dict(kv_cache_dtype="fp8", attention="flash", device="cuda"), "attention=flash"),
])
def test_the_engine_refuses_what_quantized_kv_does_not_cover(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="tiny-llama", **options)


@pytest.mark.parametrize("options,match", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
])
def test_the_manager_refuses_what_quantized_kv_does_not_cover(options, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheManager(tiny_config(**options))
