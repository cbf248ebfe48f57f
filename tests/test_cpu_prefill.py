"""The native CPU prefill attention (``vmemkv.attention.cpu_prefill``), float32 and bfloat16,
against a float64 causal reference, over slot views and shuffled block tables whose every unowned position is NaN (a read
of one shows in the output); rows of the packed batch it was not given stay untouched. Then the
engine: its prefill goes through the routine, and its tokens equal the SDPA engine's."""

from __future__ import annotations

import pytest
import torch

from decode_cases import interleaved_slots, random_sequences, shuffled_blocks
from vmemkv.attention.cpu_prefill import PrefillSpans, prefill_attention_cpu, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")

SENTINEL = 7.0


def causal_reference(q, k, v, num_cached, scale):
    """float64 attention of ``q`` ``[n, Hq, D]`` (positions num_cached ..) over ``k``/``v``
    ``[num_cached + n, Hk, D]``, each query up to its own position; ``[n, Hq, D]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, keys = q.shape[0], k.shape[0]
    seen = torch.arange(keys)[None, :] <= (num_cached + torch.arange(n))[:, None]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def make_step(cached, new, group, kv_heads, head_dim, seed=0, decode_rows=(), dtype=torch.float32):
    """Sequences of ``cached + new`` tokens, their packed queries (with ``decode_rows`` rows
    between them that belong to no span), in slots and in shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new)]
    seqs = random_sequences(lens, kv_heads, head_dim, dtype, "cpu", generator)
    starts, row = [], 0
    for b, n in enumerate(new):
        row += decode_rows[b] if b < len(decode_rows) else 0
        starts.append(row)
        row += n
    q = torch.randn(row, group * kv_heads, head_dim, generator=generator).to(dtype)
    slots = interleaved_slots(seqs, len(lens) + 2, max(lens) + 5, kv_heads, head_dim, dtype, "cpu", generator)
    blocks = shuffled_blocks(seqs, 16, kv_heads, head_dim, dtype, "cpu", generator)
    return seqs, q, starts, slots, blocks


STEPS = [
    pytest.param([0, 0], [256, 100], 3, 3, 64, id="smollm2-heads-two-prompts"),
    pytest.param([40, 0, 131], [70, 1, 33], 4, 2, 128, id="gqa4-d128-cached-prefixes-and-a-one-token-chunk"),
    pytest.param([0], [300], 1, 2, 32, id="mha-more-rows-than-an-item"),
    pytest.param([5, 63], [97, 2], 7, 1, 68, id="group-of-7-d68"),
]


# float32 to float rounding; bfloat16: the reference (of the same bf16 inputs) rounded once more
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cached, new, group, kv_heads, head_dim", STEPS)
def test_both_addressings_match_the_causal_reference(cached, new, group, kv_heads, head_dim, dtype, threads):
    seqs, q, starts, (k_cache, v_cache, slots), (k_blocks, v_blocks, tables) = make_step(
        cached, new, group, kv_heads, head_dim, decode_rows=[3, 0, 2], dtype=dtype)
    scale = head_dim ** -0.5
    vmem_spans = PrefillSpans(starts, new, cached, slots.tolist())
    paged_spans = PrefillSpans(starts, new, cached, tables.tolist(), block_size=16)
    vmem = prefill_attention_cpu(q, k_cache, v_cache, vmem_spans, scale, torch.full_like(q, SENTINEL), threads)
    paged = prefill_attention_cpu(q, k_blocks, v_blocks, paged_spans, scale, torch.full_like(q, SENTINEL), threads)
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for b, (k, v) in enumerate(seqs):
        rows = slice(starts[b], starts[b] + new[b])
        owned[rows] = True
        expected = causal_reference(q[rows], k, v, cached[b], scale).to(dtype)
        torch.testing.assert_close(vmem[rows], expected, **TOLERANCE[dtype])
    assert torch.equal(vmem, paged)  # same keys in the same order: the same float operations
    assert (vmem[~owned] == SENTINEL).all()  # rows of no span (decodes) are not written


def test_strided_query_and_output_views_of_the_engine_layout():
    """The engine passes q as ``[T, Hq, D]`` views of ``[1, Hq, T, D]`` and writes into ``[1, T, Hq, D]``."""
    seqs, q, starts, (k_cache, v_cache, slots), _ = make_step([0, 12], [50, 30], 3, 3, 64, seed=3)
    query = q.transpose(0, 1).contiguous()[None]  # [1, Hq, T, D]
    output = torch.full((1, *q.shape), SENTINEL)
    spans = PrefillSpans(starts, [50, 30], [0, 12], slots.tolist())
    prefill_attention_cpu(query[0].transpose(0, 1), k_cache, v_cache, spans, 0.125, output[0])
    for b, (k, v) in enumerate(seqs):
        rows = slice(starts[b], starts[b] + (50, 30)[b])
        torch.testing.assert_close(output[0, rows], causal_reference(q[rows], k, v, (0, 12)[b], 0.125).float(),
                                   rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    _, q, starts, (k_cache, v_cache, slots), _ = make_step([0], [20], 3, 3, 64)
    spans = PrefillSpans(starts, [20], [0], slots.tolist())
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match=r"k must be torch.bfloat16 \(as q\)"):
        prefill_attention_cpu(q.bfloat16(), k_cache, v_cache.bfloat16(), spans, 0.1, out.bfloat16())
    assert "reads float32 and bfloat16, not torch.float16" in unavailable(torch.float16, 3, 3, 64)
    with pytest.raises(ValueError, match="contiguous last dim"):
        prefill_attention_cpu(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache, spans, 0.1, out)
    with pytest.raises(ValueError, match="rows"):
        prefill_attention_cpu(q[:10], k_cache, v_cache, spans, 0.1, out[:10])
    too_long = PrefillSpans(starts, [20], [k_cache.shape[1]], slots.tolist())
    with pytest.raises(ValueError, match="keys"):
        prefill_attention_cpu(q, k_cache, v_cache, too_long, 0.1, out)
    assert "query heads per KV head" in unavailable(torch.float32, 5, 2, 64)
    assert "multiple of 4" in unavailable(torch.float32, 4, 2, 30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_prefills_through_the_routine_with_the_tokens_of_sdpa(monkeypatch, dtype):
    from vmemkv import LLM, SamplingParams
    from vmemkv.attention import packed

    calls = []
    routine = packed.prefill_attention_cpu
    monkeypatch.setattr(packed, "prefill_attention_cpu", lambda *a, **k: calls.append(a[3]) or routine(*a, **k))
    prompts = [list(range(5, 5 + n)) for n in (37, 80, 3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    native = LLM(model="tiny-llama", attention="native", threads=1, dtype=dtype).generate(prompts, params,
                                                                                         use_tqdm=False)
    assert calls and max(spans.num_queries.max().item() for spans in calls) > 1
    calls.clear()
    sdpa = LLM(model="tiny-llama", attention="sdpa", threads=1, dtype=dtype).generate(prompts, params, use_tqdm=False)
    assert not calls
    tokens = [[o.outputs[0].token_ids for o in run] for run in (native, sdpa)]
    if dtype == "bfloat16":  # rounded at other points than SDPA: the prompts' next tokens agree
        tokens = [[ids[:1] for ids in run] for run in tokens]
    assert tokens[0] == tokens[1]
