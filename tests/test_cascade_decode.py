"""Shared-prefix (cascade) decoding in the native CPU decode attention: groups of sequences whose
leading keys are one leader's rows. Each member's own copy of the prefix is NaN, so an output is
finite only if the prefix was read from the leader's rows; the outputs match a float64 reference
over the whole sequences, in both addressings, with splits, threads, soft-capping and sinks."""

from __future__ import annotations

import pytest
import torch

from decode_cases import NAN, TOLERANCES, interleaved_slots, make_case, shuffled_blocks
from vmemkv.attention.cpu_decode import decode_attention_contiguous_cpu, decode_attention_paged_cpu, unavailable
from vmemkv.attention.variants import explicit_attention

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")

# lengths, leaders, prefix lengths: a group of three over 600 keys (two prefix splits at two
# threads), a pair whose prefix is a member's whole length (nothing of its own), one alone
GROUPS = ([700, 650, 45, 612, 40, 90], [0, 0, 2, 0, 2, 5], [600, 600, 40, 600, 40, 0])


def shared_case(lens, leaders, prefix_lens, dtype, softcap=None, with_sinks=False, kv_heads=3, group=3,
                head_dim=64):
    """q, seq_lens, sinks, the float64 reference, the stored sequences (members' prefixes NaN)."""
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype, seed=11)
    seqs = [(torch.cat([seqs[leader][0][:n], k[n:]]), torch.cat([seqs[leader][1][:n], v[n:]]))
            for (k, v), leader, n in zip(seqs, leaders, prefix_lens)]
    sinks = torch.randn(q.shape[1], generator=generator) if with_sinks else None
    expected = torch.stack([
        explicit_attention(q[b, :, None].double()[None], k.transpose(0, 1)[None].double(),
                           v.transpose(0, 1)[None].double(), 0.125, None, softcap, sinks)[0, :, 0]
        for b, (k, v) in enumerate(seqs)])
    stored = []
    for b, ((k, v), n) in enumerate(zip(seqs, prefix_lens)):
        k, v = k.clone(), v.clone()
        if leaders[b] != b:
            k[:n], v[:n] = NAN, NAN  # a member's prefix is the leader's rows, never its own
        stored.append((k, v))
    return generator, q, seq_lens, sinks, expected, stored


def prefix_tensors(leaders, prefix_lens):
    return torch.tensor(leaders, dtype=torch.int32), torch.tensor(prefix_lens, dtype=torch.int32)


@pytest.mark.parametrize("threads, num_splits", [(1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_read_the_leaders_rows_and_match_the_reference(threads, num_splits, dtype):
    lens, leaders, prefix_lens = GROUPS
    generator, q, seq_lens, _, expected, stored = shared_case(lens, leaders, prefix_lens, dtype)
    k_cache, v_cache, slots = interleaved_slots(stored, 8, 720, 3, 64, dtype, "cpu", generator)
    k_blocks, v_blocks, tables = shuffled_blocks(stored, 16, 3, 64, dtype, "cpu", generator)
    shared = prefix_tensors(leaders, prefix_lens)
    options = dict(num_threads=threads, num_splits=num_splits, shared_prefix=shared)
    vmem = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, **options)
    paged = decode_attention_paged_cpu(q, k_blocks, v_blocks, tables, seq_lens, 0.125, **options)
    for out in (vmem, paged):
        assert torch.isfinite(out).all(), "a member's own (NaN) prefix rows were read"
        torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    assert torch.equal(vmem, paged)  # the same keys in the same order: the same float operations


@pytest.mark.parametrize("softcap, with_sinks", [(0.8, False), (None, True), (0.5, True)])
def test_soft_capping_and_sinks_with_shared_prefixes(softcap, with_sinks):
    lens, leaders, prefix_lens = GROUPS
    generator, q, seq_lens, sinks, expected, stored = shared_case(lens, leaders, prefix_lens, torch.float32,
                                                                  softcap, with_sinks)
    k_cache, v_cache, slots = interleaved_slots(stored, 8, 720, 3, 64, torch.float32, "cpu", generator)
    out = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, softcap=softcap,
                                          sinks=sinks, num_threads=2,
                                          shared_prefix=prefix_tensors(leaders, prefix_lens))
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


def test_a_group_of_thirty_two_over_a_system_prompt():
    """The shared-prefix workload's shape: 32 sequences after one 700-token prompt."""
    lens = [700 + 5 + i for i in range(32)]
    leaders, prefix_lens = [0] * 32, [700] * 32
    generator, q, seq_lens, _, expected, stored = shared_case(lens, leaders, prefix_lens, torch.float32)
    k_cache, v_cache, slots = interleaved_slots(stored, 32, 740, 3, 64, torch.float32, "cpu", generator)
    out = decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, num_threads=2,
                                          shared_prefix=prefix_tensors(leaders, prefix_lens))
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("leaders, prefix_lens, window, match", [
    ([0, 5, 2], [10, 10, 0], None, "every leader leads itself"),
    ([1, 0, 2], [10, 10, 0], None, "every leader leads itself"),
    ([0, 0, 2], [10, 12, 0], None, "its leader's"),
    ([0, 0, 2], [30, 30, 0], None, "at most its own length"),
    ([0, 0], [10, 10], None, r"two \[batch\] = \[3\]"),
    ([0, 0, 2], [10, 10, 0], 8, "sliding window"),
], ids=["out-of-range", "leader-follows", "unequal-lengths", "too-long", "wrong-shape", "window"])
def test_wrong_prefixes_are_refused_and_write_nothing(leaders, prefix_lens, window, match):
    generator, q, seq_lens, _, _, stored = shared_case([20, 20, 20], [0, 1, 2], [0, 0, 0], torch.float32)
    k_cache, v_cache, slots = interleaved_slots(stored, 4, 24, 3, 64, torch.float32, "cpu", generator)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match=match):
        decode_attention_contiguous_cpu(q, k_cache, v_cache, slots, seq_lens, 0.125, out=out, window=window,
                                        shared_prefix=prefix_tensors(leaders, prefix_lens))
    assert (out == 7.0).all()
