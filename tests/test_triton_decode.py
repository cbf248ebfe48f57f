"""Triton decode attention: the vmem (contiguous) and paged (block-table) kernels against a float64
reference, against each other, and on the bytes a real manager maps (GPU).

On CPU the kernels run under Triton's interpreter, which must be switched on *before* triton is
first imported: this file sets ``TRITON_INTERPRET=1`` at its top when no CUDA GPU is present and
triton is not imported yet. When something imported triton earlier in the same pytest process
(compiled mode), the CPU cases skip here and ``test_cpu_cases_in_a_fresh_process`` runs this file
again in a child process with the variable set, so they run either way. With a GPU the variable
is never set here (it would turn every later kernel into an interpreted one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="needs Triton (pip install triton)")

from vmemkv import KVLayout
from vmemkv.attention.triton_decode import (
    decode_attention_contiguous,
    decode_attention_paged,
    triton_interprets,
)
from vmemkv.memory.quantized_rows import dequantize, quantize
from decode_cases import (NAN, assert_matches, interleaved_slots, make_case, reference, shuffled_blocks,
                          variant_case)

INTERPRETS = triton_interprets()
cpu_case = pytest.mark.skipif(
    not INTERPRETS,
    reason="triton was imported in compiled mode before this file (or a GPU is present), so CPU tensors "
           "cannot run here; test_cpu_cases_in_a_fresh_process runs these cases in a child process")
gpu_case = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# --- CPU cases (interpreter): small shapes --------------------------------------------------------
# (batch lens, GQA group, kv heads, head dim, dtype): lengths 1, and lengths that are not multiples
# of BLOCK_N (32 under the interpreter) nor of the block sizes used (16 and 5).
CASES = [
    pytest.param([1, 77, 40], 4, 2, 64, torch.float16, id="fp16-gqa4-d64-b3"),
    pytest.param([45, 17], 1, 2, 32, torch.float32, id="fp32-mha-d32-b2"),
    pytest.param([33], 1, 1, 128, torch.float16, id="fp16-mha-d128-b1"),
    pytest.param([1, 2, 65, 40, 9], 4, 1, 128, torch.float32, id="fp32-gqa4-d128-b5"),
]


@cpu_case
@pytest.mark.parametrize("lens, group, kv_heads, head_dim, dtype", CASES)
def test_contiguous_matches_reference_on_interleaved_strided_views(lens, group, kv_heads, head_dim, dtype):
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype)
    k_cache, v_cache, slots = interleaved_slots(seqs, len(lens) + 2, max(lens) + 7, kv_heads, head_dim, dtype,
                                                "cpu", generator)
    assert not k_cache.is_contiguous() and k_cache.stride(1) == 4 * kv_heads * head_dim
    scale = head_dim ** -0.5
    out = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, scale)
    assert_matches(out, reference(q, seqs, scale), dtype)


@cpu_case
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("lens, group, kv_heads, head_dim, dtype", CASES[:2] + CASES[3:])
def test_paged_matches_reference_on_shuffled_block_tables(lens, group, kv_heads, head_dim, dtype, block_size):
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype, seed=1)
    k_blocks, v_blocks, tables = shuffled_blocks(seqs, block_size, kv_heads, head_dim, dtype, "cpu", generator)
    scale = head_dim ** -0.5
    out = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, scale)
    assert_matches(out, reference(q, seqs, scale), dtype)


@cpu_case
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_vmem_and_paged_read_the_same_bytes_and_agree_exactly(dtype):
    """One pool window of the token-major layout, addressed both ways through KVLayout's geometry:
    as slots (each sequence's pages consecutive in the window, as the MMU shows them) and as blocks
    through a block table. Same bytes, same tiles: the outputs are identical."""
    num_layers, kv_heads, head_dim, tokens_per_page = 2, 2, 32, 16
    layout = KVLayout(num_layers, kv_heads, head_dim, dtype,
                      page_size=tokens_per_page * 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8)
    lens, pages_per_slot, num_slots = [50, 1, 64, 23], 4, 5
    _, seqs, q, seq_lens = make_case(lens, 4, kv_heads, head_dim, dtype, seed=2)
    window = torch.full((num_slots * pages_per_slot * layout.page_size // layout.itemsize,), NAN, dtype=dtype)
    block_elems = layout.block_bytes // layout.itemsize
    slot_ids = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    layer = 1
    (token_stride, head_stride, _), _ = layout.slot_view_geometry(layer, 0, pages_per_slot * tokens_per_page)
    k_slots, v_slots = (window.as_strided((num_slots, pages_per_slot * tokens_per_page, kv_heads, head_dim),
                                          (pages_per_slot * block_elems, token_stride, head_stride, 1),
                                          layout.slot_view_geometry(layer, kv, 0)[1]) for kv in (0, 1))
    block_shape = (num_slots * pages_per_slot, tokens_per_page, kv_heads, head_dim)
    k_blocks, v_blocks = (window.as_strided(block_shape, *layout.block_view_geometry(layer, kv)) for kv in (0, 1))
    for slot, (k, v) in zip(slot_ids.tolist(), seqs):
        k_slots[slot, :k.shape[0]] = k
        v_slots[slot, :v.shape[0]] = v
    tables = (slot_ids[:, None] * pages_per_slot + torch.arange(pages_per_slot)[None, :]).to(torch.int32)
    scale = head_dim ** -0.5
    vmem = decode_attention_contiguous(q, k_slots, v_slots, slot_ids, seq_lens, scale)
    paged = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, scale)
    assert torch.equal(vmem, paged)
    assert_matches(vmem, reference(q, seqs, scale), dtype)


@cpu_case
def test_split_k_matches_reference_and_empty_sequences_give_zeros():
    lens, group, kv_heads, head_dim, dtype = [1, 70, 0, 33], 4, 1, 32, torch.float16
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype, seed=3)
    k_cache, v_cache, slots = interleaved_slots(seqs, 4, 80, kv_heads, head_dim, dtype, "cpu", generator)
    k_blocks, v_blocks, tables = shuffled_blocks(seqs, 16, kv_heads, head_dim, dtype, "cpu", generator)
    scale = 0.3
    expected = reference(q, seqs, scale)
    vmem = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, scale, num_splits=3)
    paged = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, scale, num_splits=3)
    assert_matches(vmem, expected, dtype)
    assert torch.equal(vmem, paged)
    assert (vmem[2] == 0).all()


@cpu_case
def test_head_dim_that_is_not_a_power_of_two_is_padded():
    lens, head_dim, dtype = [20, 3], 48, torch.float32
    generator, seqs, q, seq_lens = make_case(lens, 2, 1, head_dim, dtype, seed=4)
    k_cache, v_cache, slots = interleaved_slots(seqs, 2, 24, 1, head_dim, dtype, "cpu", generator)
    out = torch.empty_like(q)
    result = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, 0.2, out=out)
    assert result is out
    assert_matches(out, reference(q, seqs, 0.2), dtype)


@cpu_case
@pytest.mark.parametrize("window, softcap, with_sinks, num_splits", [
    (7, None, False, 1), (None, 0.8, False, 1), (None, None, True, 3), (5, 0.5, True, 1), (5, 0.5, True, 3)],
    ids=["window", "softcap", "sinks-split", "all", "all-split"])
def test_layer_variants_match_the_explicit_reference(window, softcap, with_sinks, num_splits):
    """Sliding window, soft-capping, sinks, against ``variants.explicit_attention`` in float64.
    Positions behind each window are NaN in both caches: a read of one would show in the output."""
    q, seq_lens, sinks, expected, (k_cache, v_cache, slots), (k_blocks, v_blocks, tables) = variant_case(
        [1, 70, 6, 33], window, softcap, with_sinks, num_slots=5)
    dtype = torch.float32
    variant = dict(num_splits=num_splits, window=window, softcap=softcap, sinks=sinks)
    vmem = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, 0.3, **variant)
    paged = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, 0.3, **variant)
    assert_matches(vmem, expected, dtype)
    assert_matches(paged, expected, dtype)


# --- validation (no launch) -----------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    k = torch.zeros(3, 8, 2, 64, dtype=torch.float16)
    slots = torch.zeros(2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim 512 is not supported"):
        big = torch.zeros(2, 4, 512, dtype=torch.float16)
        decode_attention_contiguous(big, big.new_zeros(3, 8, 2, 512), big.new_zeros(3, 8, 2, 512), slots, lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention_contiguous(q[:, :3], k, k, slots, lens, 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_attention_contiguous(q, k.float(), k.float(), slots, lens, 1.0)
    with pytest.raises(ValueError, match="not supported"):
        decode_attention_contiguous(q.double(), k.double(), k.double(), slots, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.zeros(3, 8, 2, 64, 2, dtype=torch.float16)[..., 0]
        decode_attention_contiguous(q, wide, wide, slots, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be"):
        decode_attention_contiguous(q, k, k, slots, lens[:1], 1.0)
    with pytest.raises(ValueError, match="slot_ids must be"):
        decode_attention_contiguous(q, k, k, slots.float(), lens, 1.0)
    with pytest.raises(ValueError, match="same shape"):
        decode_attention_contiguous(q, k, k[:, :4], slots, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be"):
        decode_attention_paged(q, k, k, torch.zeros(2, 3, dtype=torch.float32), lens, 1.0)
    with pytest.raises(ValueError, match="block_n"):
        decode_attention_contiguous(q, k, k, slots, lens, 1.0, block_n=24)
    with pytest.raises(ValueError, match="window must be a positive"):
        decode_attention_contiguous(q, k, k, slots, lens, 1.0, window=0)
    with pytest.raises(ValueError, match="softcap must be positive"):
        decode_attention_contiguous(q, k, k, slots, lens, 1.0, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must be \[num_q_heads\] = \[4\]"):
        decode_attention_paged(q, k, k, torch.zeros(2, 3, dtype=torch.int32), lens, 1.0, sinks=torch.zeros(2))


@cpu_case
def test_check_bounds_refuses_lengths_slots_and_blocks_out_of_range():
    q = torch.zeros(2, 4, 32, dtype=torch.float16)
    k = torch.zeros(3, 8, 2, 32, dtype=torch.float16)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 8\]"):
        decode_attention_contiguous(q, k, k, slots, torch.tensor([1, 9], dtype=torch.int32), 1.0, check_bounds=True)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 2\]"):
        decode_attention_contiguous(q, k, k, torch.tensor([0, 3], dtype=torch.int32),
                                    torch.tensor([1, 1], dtype=torch.int32), 1.0, check_bounds=True)
    tables = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)  # 99 is past the 3 blocks ...
    lens = torch.tensor([16, 8], dtype=torch.int32)  # ... but sequence 1 uses only its first block
    decode_attention_paged(q, k, k, tables, lens, 1.0, check_bounds=True)
    with pytest.raises(ValueError, match="block table entries in use"):
        decode_attention_paged(q, k, k, tables, torch.tensor([16, 9], dtype=torch.int32), 1.0, check_bounds=True)
    # behind a window of 4 the first block of each sequence is not read: released (-1) there is fine
    released = torch.tensor([[-1, 1], [-1, 2]], dtype=torch.int32)
    decode_attention_paged(q, k, k, released, torch.tensor([16, 14], dtype=torch.int32), 1.0,
                           check_bounds=True, window=4)
    with pytest.raises(ValueError, match="block table entries in use"):  # a window of 9 reads it
        decode_attention_paged(q, k, k, released, torch.tensor([16, 14], dtype=torch.int32), 1.0,
                               check_bounds=True, window=9)


def quantized_case(dtype, q_dtype, num_slots, max_tokens, kv_heads, head_dim, device, seed):
    """Slots of quantized rows (``quantized_rows``) with their scales, and the same rows dequantized
    to float32: the float reference a quantized read must match."""
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_slots, max_tokens, kv_heads, head_dim, generator=generator) for _ in (0, 1))
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    floats = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
    to = dict(device=device)
    return ((kq.to(**to), vq.to(**to)), (ks.to(**to), vs.to(**to)), tuple(t.to(**to) for t in floats),
            torch.randn(3, 4 * kv_heads, head_dim, generator=generator).to(q_dtype).to(**to))


@cpu_case
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim, num_splits", [(64, 1), (64, 2), (24, 1)])
def test_quantized_rows_read_as_their_float_reference(dtype, head_dim, num_splits):
    """int8 / fp8 rows with a scale per 32 values (one per row at head_dim 24): the kernel's read
    equals its read of the same rows dequantized to float32."""
    (kq, vq), scales, (kd, vd), q = quantized_case(dtype, torch.float32, 3, 80, 2, head_dim, "cpu", 1)
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([77, 40, 1], dtype=torch.int32)
    expected = decode_attention_contiguous(q, kd, vd, slots, lens, 0.125, num_splits=num_splits)
    got = decode_attention_contiguous(q, kq, vq, slots, lens, 0.125, kv_scales=scales, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def blocks_of(slots: torch.Tensor, size: int):
    """``[num_slots, T, ...]`` slots cut into blocks of ``size`` tokens, the blocks shuffled: the
    block tensor and each slot's block table."""
    num_slots, tokens = slots.shape[:2]
    per_slot = tokens // size
    order = torch.randperm(num_slots * per_slot, generator=torch.Generator().manual_seed(3))
    blocks = torch.empty_like(slots.reshape(num_slots * per_slot, size, *slots.shape[2:]))
    blocks[order] = slots.reshape(num_slots * per_slot, size, *slots.shape[2:])
    return blocks, order.view(num_slots, per_slot).to(torch.int32)


@cpu_case
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_blocks_read_as_the_same_slots(dtype):
    """int8 / fp8 rows and their scales cut into shuffled blocks of 16 tokens: the block-table
    read equals the slot read of the same rows."""
    (kq, vq), (ks, vs), _, q = quantized_case(dtype, torch.float32, 3, 80, 2, 64, "cpu", 2)
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([77, 40, 1], dtype=torch.int32)
    (k_blocks, tables), (v_blocks, _) = blocks_of(kq, 16), blocks_of(vq, 16)
    (ks_blocks, _), (vs_blocks, _) = blocks_of(ks, 16), blocks_of(vs, 16)
    expected = decode_attention_contiguous(q, kq, vq, slots, lens, 0.125, kv_scales=(ks, vs))
    got = decode_attention_paged(q, k_blocks, v_blocks, tables[slots], lens, 0.125, kv_scales=(ks_blocks, vs_blocks))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.skipif(INTERPRETS, reason="the CPU cases run in this process")
@pytest.mark.skipif(HAS_CUDA and not os.environ.get("VMEMKV_TEST_INTERPRETER"),
                    reason="GPU present: the CPU interpreter cases are left to CPU machines "
                           "(set VMEMKV_TEST_INTERPRETER=1 to run them here too)")
def test_cpu_cases_in_a_fresh_process():
    """triton was imported in compiled mode before this file: run the CPU cases in a child process
    that starts with TRITON_INTERPRET=1 and no visible GPU."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
         "-k", "not test_cpu_cases_in_a_fresh_process", str(Path(__file__))],
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"child pytest failed (rc {child.returncode}):\n{child.stdout[-6000:]}\n{child.stderr[-3000:]}"
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, child.stdout[-2000:]


# --- GPU cases: realistic sizes, compiled kernels -------------------------------------------------

# Few cases: each compiles its own kernel variants (seconds each on a fresh machine).
GPU_CASES = [
    pytest.param(torch.bfloat16, 4, 128, None, id="bf16-gqa4-d128-split"),
    pytest.param(torch.bfloat16, 4, 128, 1, id="bf16-gqa4-d128-nosplit"),
    pytest.param(torch.float16, 1, 64, None, id="fp16-mha-d64-split"),
    pytest.param(torch.float32, 8, 256, 3, id="fp32-gqa8-d256-split3"),
]


@pytest.mark.parametrize("dtype, group, head_dim, num_splits", GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_both_kernels_match_reference(dtype, group, head_dim, num_splits):
    kv_heads = 8 if head_dim <= 128 else 2
    lens = [1, 4095, 517, 2048, 33, 1000, 3000, 16]
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype, device="cuda", seed=5)
    k_cache, v_cache, slots = interleaved_slots(seqs, len(lens) + 1, 4100, kv_heads, head_dim, dtype, "cuda",
                                                generator, num_layers=4, layer=2)
    k_blocks, v_blocks, tables = shuffled_blocks(seqs, 16, kv_heads, head_dim, dtype, "cuda", generator,
                                                 num_layers=4, layer=2)
    scale = head_dim ** -0.5
    expected = reference(q, seqs, scale)
    # the same max_seq_len for both, so the default split-K factor is the same too
    vmem = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, scale, num_splits=num_splits,
                                       max_seq_len=max(lens))
    paged = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, scale, num_splits=num_splits,
                                   max_seq_len=max(lens))
    assert_matches(vmem, expected, dtype)
    assert_matches(paged, expected, dtype)
    torch.testing.assert_close(vmem, paged, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_quantized_rows_read_as_their_float_reference(dtype):
    """Compiled: bf16 queries over int8 / fp8 rows and their scales (4,000 tokens a slot, split-K)
    against the same rows dequantized, read by the bf16 kernel."""
    (kq, vq), scales, (kd, vd), q = quantized_case(dtype, torch.bfloat16, 4, 4000, 8, 128, "cuda", 7)
    slots = torch.tensor([3, 0, 2], device="cuda")
    lens = torch.tensor([3999, 517, 1], dtype=torch.int32, device="cuda")
    expected = decode_attention_contiguous(q, kd.bfloat16(), vd.bfloat16(), slots, lens, 128 ** -0.5)
    got = decode_attention_contiguous(q, kq, vq, slots, lens, 128 ** -0.5, kv_scales=scales)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)
    (k_blocks, tables), (v_blocks, _) = blocks_of(kq.cpu(), 16), blocks_of(vq.cpu(), 16)
    (ks_blocks, _), (vs_blocks, _) = blocks_of(scales[0].cpu(), 16), blocks_of(scales[1].cpu(), 16)
    paged = decode_attention_paged(q, k_blocks.cuda(), v_blocks.cuda(), tables.cuda()[slots], lens, 128 ** -0.5,
                                   kv_scales=(ks_blocks.cuda(), vs_blocks.cuda()))
    torch.testing.assert_close(paged, got, atol=1e-6, rtol=0)  # through block tables: the same read


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_slot_stride_past_2_to_the_31_elements():
    """Offsets are int64: a slot stride of 2^31 + 2^20 elements (cf. flash-attn issue 772)."""
    kv_heads, head_dim, dtype, max_tokens = 2, 64, torch.float16, 64
    slot_stride = (1 << 31) + (1 << 20)
    if torch.cuda.mem_get_info()[0] < 2 * (2 * slot_stride + max_tokens * 512) + (1 << 30):
        pytest.skip("needs about 9 GiB of free GPU memory")
    lens = [40, 64, 1]
    _, seqs, q, seq_lens = make_case(lens, 4, kv_heads, head_dim, dtype, device="cuda", seed=6)
    storage = torch.empty(2 * slot_stride + max_tokens * 4 * kv_heads * head_dim, dtype=dtype, device="cuda")
    k_cache = storage.as_strided((3, max_tokens, kv_heads, head_dim), (slot_stride, 4 * kv_heads * head_dim,
                                                                       head_dim, 1))
    v_cache = storage.as_strided(k_cache.shape, k_cache.stride(), kv_heads * head_dim)
    slots = torch.tensor([2, 1, 0], dtype=torch.int32, device="cuda")
    for slot, (k, v) in zip(slots.tolist(), seqs):
        k_cache[slot, :k.shape[0]] = k
        v_cache[slot, :v.shape[0]] = v
    out = decode_attention_contiguous(q, k_cache, v_cache, slots, seq_lens, 0.125)
    assert_matches(out, reference(q, seqs, 0.125), dtype)
    del storage


def _cuda_bindings_missing() -> bool:
    try:
        from vmemkv.memory.vmm.cuda import load_driver
        load_driver()
    except Exception:  # noqa: BLE001 - any failure to load the driver means: skip
        return True
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_kernels_on_a_real_manager_agree_and_read_only_mapped_pages():
    """CUDA VMM pages from the manager: vmem reads the slot views, paged reads the pool window
    through the block tables (with a shared prefix page); both give the reference answer and never
    touch unmapped addresses (which would fault)."""
    if _cuda_bindings_missing():
        pytest.skip("needs cuda-python (pip install cuda-bindings)")
    from vmemkv import CacheConfig, KVCacheManager

    # Llama-3-8B's geometry: 128 KiB per token, so one 2 MiB page holds 16 tokens.
    num_layers, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    config = CacheConfig(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=64,
                         max_num_seqs=6, max_model_len=2048, dtype=dtype, device="cuda",
                         hash_seed=b"triton-decode")
    generator = torch.Generator().manual_seed(7)
    shared = list(range(1, 40))  # two full pages of 16 shared by requests a and b
    prompts = {"a": shared + [100], "b": shared + list(range(200, 260)), "c": list(range(300, 301)),
               "d": list(range(400, 700))}
    with KVCacheManager(config) as manager:
        layer = 2
        k_views, v_views = manager.kv_views(layer)
        seqs = {}
        for request_id, prompt in prompts.items():
            cached = manager.admit(request_id, prompt)
            assert cached is not None
            slot = manager.slot_of(request_id)
            if cached:
                k_old, v_old = seqs["a"]
                k_new, v_new = random_sequences([len(prompt) - cached], kv_heads, head_dim, dtype, "cuda",
                                                generator)[0]
                k, v = torch.cat([k_old[:cached], k_new]), torch.cat([v_old[:cached], v_new])
            else:
                k, v = random_sequences([len(prompt)], kv_heads, head_dim, dtype, "cuda", generator)[0]
            k_views[slot, cached:len(prompt)] = k[cached:]
            v_views[slot, cached:len(prompt)] = v[cached:]
            manager.commit(request_id)
            seqs[request_id] = (k, v)
        assert manager.block_table("b")[:2] == manager.block_table("a")[:2], "expected a prefix hit"
        order = ["d", "b", "c", "a"]
        torch.cuda.synchronize()
        seq_lens = torch.tensor([len(prompts[r]) for r in order], dtype=torch.int32, device="cuda")
        slots = torch.tensor([manager.slot_of(r) for r in order], dtype=torch.int32, device="cuda")
        width = max(len(manager.block_table(r)) for r in order)
        tables = torch.tensor([manager.block_table(r) + [0] * (width - len(manager.block_table(r))) for r in order],
                              dtype=torch.int32, device="cuda")
        q = torch.randn(len(order), 4 * kv_heads, head_dim, generator=generator).to(dtype=dtype, device="cuda")
        scale = head_dim ** -0.5
        k_blocks, v_blocks = manager.block_views(layer)
        longest = int(seq_lens.max())
        vmem = decode_attention_contiguous(q, k_views, v_views, slots, seq_lens, scale, check_bounds=True,
                                           max_seq_len=longest)
        paged = decode_attention_paged(q, k_blocks, v_blocks, tables, seq_lens, scale, check_bounds=True,
                                       max_seq_len=longest)
        torch.cuda.synchronize()
        expected = reference(q, [seqs[r] for r in order], scale)
        assert_matches(vmem, expected, dtype)
        torch.testing.assert_close(vmem, paged, atol=1e-6, rtol=1e-6)
        for request_id in order:
            manager.free(request_id)
        manager.check()
