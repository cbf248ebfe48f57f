"""The native CPU decode attention (``vmemkv.attention.cpu_decode``) against a float64 reference,
vmem against paged on the same bytes, with windows, soft-capping, sinks, split keys and threads;
positions no sequence owns are NaN, so a read of one shows in the output. Then the engine with
``attention="native"`` against HF ``generate`` token for token."""

from __future__ import annotations

import pytest
import torch

from decode_cases import (assert_matches, interleaved_slots, make_case, reference, shuffled_blocks,
                          variant_case)
from vmemkv.attention import cpu_decode
from vmemkv.attention.cpu_decode import (LayerCalls, decode_attention_contiguous_cpu, decode_attention_paged_cpu,
                                         num_splits_for, unavailable)

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")


@pytest.fixture(params=[True, False], ids=["grouped-heads", "per-head"])
def heads_path(request):
    """Both tile loops: a kv head's query heads together (AVX-512's, where this CPU has it) and
    one head at a time (AVX2's and the baseline's)."""
    extension = cpu_decode._extension()
    if request.param and not extension.grouped_heads():
        pytest.skip("grouped heads need AVX-512, which this CPU lacks")
    before = extension.grouped_heads(request.param)
    yield request.param
    extension.grouped_heads(before)

CASES = [
    pytest.param([1, 77, 40], 4, 2, 64, torch.float32, id="fp32-gqa4-d64-b3"),
    pytest.param([45, 17], 1, 2, 32, torch.bfloat16, id="bf16-mha-d32-b2"),
    pytest.param([300, 2, 129], 3, 3, 64, torch.float32, id="fp32-gqa3-d64-smollm2-heads"),
    pytest.param([1, 2, 65, 40, 9], 4, 1, 128, torch.bfloat16, id="bf16-gqa4-d128-b5"),
    pytest.param([300, 2, 129], 3, 3, 64, torch.bfloat16, id="bf16-gqa3-d64-smollm2-heads"),
    pytest.param([20, 3], 2, 1, 48, torch.float32, id="fp32-d48"),
    # 5 query heads a kv head: read 3 then 2 at a time; a head size not a multiple of 16: one head at a time
    pytest.param([33, 70], 5, 2, 40, torch.float32, id="fp32-gqa5-d40"),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens, group, kv_heads, head_dim, dtype", CASES)
def test_both_addressings_match_the_reference_and_each_other(lens, group, kv_heads, head_dim, dtype, threads,
                                                             heads_path):
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype)
    k_cache, v_cache, slots = interleaved_slots(seqs, len(lens) + 2, max(lens) + 7, kv_heads, head_dim, dtype,
                                                "cpu", generator)
    k_blocks, v_blocks, tables = shuffled_blocks(seqs, 16, kv_heads, head_dim, dtype, "cpu", generator)
    scale = head_dim ** -0.5
    vmem = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, scale, num_threads=threads)
    paged = decode_attention_paged_cpu(q, k_blocks, v_blocks, tables, seq_lens, scale, num_threads=threads)
    assert_matches(vmem, reference(q, seqs, scale), dtype)
    assert torch.equal(vmem, paged)  # same keys in the same order: the same float operations


@pytest.mark.parametrize("window, softcap, with_sinks, num_splits", [
    (7, None, False, 1), (None, 0.8, False, 1), (None, None, True, 3), (5, 0.5, True, 1), (5, 0.5, True, 3),
    (None, None, False, 4)], ids=["window", "softcap", "sinks-split", "all", "all-split", "split"])
def test_layer_variants_match_the_explicit_reference(window, softcap, with_sinks, num_splits, heads_path):
    q, seq_lens, sinks, expected, (k_cache, v_cache, slots), (k_blocks, v_blocks, tables) = variant_case(
        [1, 70, 6, 33, 0], window, softcap, with_sinks, num_slots=6)
    dtype = torch.float32
    variant = dict(num_splits=num_splits, window=window, softcap=softcap, sinks=sinks, num_threads=2)
    vmem = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.3, **variant)
    paged = decode_attention_paged_cpu(q, k_blocks, v_blocks, tables, seq_lens, 0.3, **variant)
    assert_matches(vmem, expected, dtype)
    assert_matches(paged, expected, dtype)
    assert (vmem[4] == 0).all()


def test_split_keys_of_a_long_sequence_match_one_pass():
    generator, seqs, q, seq_lens = make_case([2000], 3, 3, 64, torch.float32, seed=7)
    k_cache, v_cache, slots = interleaved_slots(seqs, 2, 2048, 3, 64, torch.float32, "cpu", generator)
    assert num_splits_for(1, 2000, threads=8) > 1 and num_splits_for(8, 2000, threads=8) == 1
    one = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, num_splits=1)
    split = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, num_splits=5,
                                            num_threads=2)
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-5)
    assert_matches(split, reference(q, seqs, 0.125), torch.float32)


def test_bad_inputs_raise_clear_errors():
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(3, 8, 2, 64)
    slots, lens = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="reads float32 and bfloat16"):
        decode_attention_contiguous_cpu(q.half(), k.half(), k.half(), slots, lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention_contiguous_cpu(q[:, :3], k, k, slots, lens, 1.0)
    with pytest.raises(ValueError, match="slot_ids must be"):
        decode_attention_contiguous_cpu(q, k, k, slots.float(), lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be"):
        decode_attention_paged_cpu(q, k, k, torch.zeros(2, 3), lens, 1.0)
    with pytest.raises(ValueError, match="window must be a positive"):
        decode_attention_contiguous_cpu(q, k, k, slots, lens, 1.0, window=0)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 2\]"):
        decode_attention_contiguous_cpu(q, k, k, torch.tensor([0, 3], dtype=torch.int32), lens, 1.0,
                                        check_bounds=True)
    with pytest.raises(ValueError, match="block table entries in use"):
        decode_attention_paged_cpu(q, k, k, torch.tensor([[0, 1], [2, 99]], dtype=torch.int32),
                                   torch.tensor([16, 9], dtype=torch.int32), 1.0, check_bounds=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_rows_are_written_before_the_reads(dtype):
    """``new_kv``: each sequence's last row arrives with the call (its cached copy is NaN until
    then); it lands at ``seq_lens[b] - 1`` and nowhere else, and the output is the reference's."""
    lens = [1, 77, 40, 300]
    generator, seqs, q, seq_lens = make_case(lens, 3, 3, 64, dtype, seed=3)
    new_k = torch.stack([k[-1] for k, _ in seqs])
    new_v = torch.stack([v[-1] for _, v in seqs])
    stale = [(k.clone(), v.clone()) for k, v in seqs]
    for k, v in stale:
        k[-1], v[-1] = float("nan"), float("nan")
    k_cache, v_cache, slots = interleaved_slots(stale, 6, 310, 3, 64, dtype, "cpu", generator)
    k_blocks, v_blocks, tables = shuffled_blocks(stale, 16, 3, 64, dtype, "cpu", generator)
    expected_k = k_cache.clone()
    expected_k[slots.long(), seq_lens.long() - 1] = new_k
    vmem = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, num_threads=2,
                                           new_kv=(new_k, new_v))
    paged = decode_attention_paged_cpu(q, k_blocks, v_blocks, tables, seq_lens, 0.125, num_threads=2,
                                       new_kv=(new_k, new_v))
    assert_matches(vmem, reference(q, seqs, 0.125), dtype)
    assert torch.equal(vmem, paged)
    assert torch.equal(k_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))  # that row, nothing else


def test_layers_of_a_step_reuse_the_checked_call_with_their_own_tensors():
    """``calls``: the second layer (same geometry, other bytes, other new rows) runs the first
    layer's checked arguments with its own pointers and matches its own reference; a call of
    another geometry (fewer query heads) is checked and marshalled afresh, and a wrong one is
    still refused."""
    lens = [5, 77, 40]
    calls = LayerCalls()
    for layer, seed in enumerate((3, 4)):  # two layers: their own K/V views, queries and new rows
        generator, seqs, q, seq_lens = make_case(lens, 3, 3, 64, torch.float32, seed=seed)
        if layer == 1:
            seq_lens = first_lens  # one step: the lengths tensor every layer passes
        new_k = torch.stack([k[-1] for k, _ in seqs])
        new_v = torch.stack([v[-1] for _, v in seqs])
        stale = [(k.clone(), v.clone()) for k, v in seqs]
        for k, v in stale:
            k[-1], v[-1] = float("nan"), float("nan")
        k_cache, v_cache, slots = interleaved_slots(stale, 4, 80, 3, 64, torch.float32, "cpu", generator)
        if layer == 0:
            first_lens, first_slots = seq_lens, slots
        assert torch.equal(slots, first_slots)  # the same slots for both layers' views
        out = torch.empty_like(q)
        got = decode_attention_contiguous_cpu(q, k_cache, v_cache, first_slots, seq_lens, 0.125, out=out,
                                              new_kv=(new_k, new_v), calls=calls)
        assert got is out
        assert_matches(out, reference(q, seqs, 0.125), torch.float32)
        assert len(calls._calls) == 1
    narrower = q[:, :6]  # 2 query heads a KV head: another geometry
    expected = reference(narrower, seqs, 0.125)
    assert_matches(decode_attention_contiguous_cpu(narrower, k_cache, v_cache, first_slots, seq_lens, 0.125,
                                                   calls=calls), expected, torch.float32)
    assert len(calls._calls) == 2
    with pytest.raises(ValueError, match="num_q_heads"):
        decode_attention_contiguous_cpu(q[:, :5], k_cache, v_cache, first_slots, seq_lens, 0.125, calls=calls)


def test_wrong_new_rows_are_refused_and_write_nothing():
    generator, seqs, q, seq_lens = make_case([20, 9], 2, 2, 32, torch.float32)
    k_cache, v_cache, slots = interleaved_slots(seqs, 3, 24, 2, 32, torch.float32, "cpu", generator)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"new_kv must be two CPU \[2, 2, 32\] tensors"):
        decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125,
                                        new_kv=(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)))
    assert torch.equal(k_cache.nan_to_num(7.0), before.nan_to_num(7.0))
