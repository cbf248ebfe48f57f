"""K/V cases for the decode attention tests (Triton and native CPU): random sequences laid out in
token-major slots and in shuffled blocks, NaN wherever no sequence lives, and a float64 reference."""

from __future__ import annotations

import torch

NAN = float("nan")
TOLERANCES = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 3e-3, "rtol": 1e-2},
              torch.bfloat16: {"atol": 2e-2, "rtol": 5e-2}}


def random_sequences(lens, num_kv_heads, head_dim, dtype, device, generator):
    """Per-sequence K and V, ``[len, kv_heads, head_dim]`` each."""
    seqs = []
    for length in lens:
        k = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        seqs.append((k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)))
    return seqs


def reference(q, seqs, scale):
    """float64 softmax(q k^T scale) v per sequence, GQA by repeating kv heads; [B, Hq, D]."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, (k, v) in enumerate(seqs):
        if k.shape[0] == 0:
            continue
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


def interleaved_slots(seqs, num_slots, max_tokens, num_kv_heads, head_dim, dtype, device, generator,
                      num_layers=2, layer=1):
    """A token-major ``[slot, token, layer*2 + kv, head, dim]`` buffer, NaN wherever no sequence
    lives (past each length, other layers, unused slots); sequences sit in shuffled slots.
    Returns layer ``layer``'s strided K and V views and the slot ids."""
    buffer = torch.full((num_slots, max_tokens, 2 * num_layers, num_kv_heads, head_dim), NAN, dtype=dtype,
                        device=device)
    k_cache, v_cache = buffer[:, :, 2 * layer], buffer[:, :, 2 * layer + 1]
    slots = torch.randperm(num_slots, generator=generator)[:len(seqs)]
    for slot, (k, v) in zip(slots.tolist(), seqs):
        k_cache[slot, :k.shape[0]] = k
        v_cache[slot, :v.shape[0]] = v
    return k_cache, v_cache, slots.to(device=device, dtype=torch.int32)


def shuffled_blocks(seqs, block_size, num_kv_heads, head_dim, dtype, device, generator, spare_blocks=3,
                    num_layers=2, layer=1, table_width=None):
    """Interleaved ``[block, token, layer*2 + kv, head, dim]`` blocks in a shuffled order, NaN
    everywhere no token lives. Table entries past a sequence's blocks point at a NaN block."""
    needed = [-(-k.shape[0] // block_size) for k, _ in seqs]
    num_blocks = sum(needed) + spare_blocks
    buffer = torch.full((num_blocks, block_size, 2 * num_layers, num_kv_heads, head_dim), NAN, dtype=dtype,
                        device=device)
    k_blocks, v_blocks = buffer[:, :, 2 * layer], buffer[:, :, 2 * layer + 1]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    poison = order.pop()  # never written: NaN
    width = table_width or max(max(needed), 1) + 1
    tables = torch.full((len(seqs), width), poison, dtype=torch.int32)
    for b, (k, v) in enumerate(seqs):
        for j in range(needed[b]):
            block = order.pop()
            tables[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, k.shape[0]))
            k_blocks[block, :rows.stop - rows.start] = k[rows]
            v_blocks[block, :rows.stop - rows.start] = v[rows]
    return k_blocks, v_blocks, tables.to(device)


def make_case(batch_lens, group, num_kv_heads, head_dim, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    seqs = random_sequences(batch_lens, num_kv_heads, head_dim, dtype, device, generator)
    q = torch.randn(len(batch_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype=dtype,
                                                                                             device=device)
    seq_lens = torch.tensor(batch_lens, dtype=torch.int32, device=device)
    return generator, seqs, q, seq_lens


def assert_matches(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out).all(), "NaN/inf in the output: a position past a sequence was read"
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def variant_case(lens, window, softcap, with_sinks, num_slots, seed=5):
    """Sequences of ``lens`` (2 kv heads, GQA 2, head dim 32, float32) in slots and in blocks, with
    everything behind each window NaN, and the float64 ``explicit_attention`` reference of the
    variant (zeros for an empty sequence). Returns q, seq_lens, sinks, expected, (k_cache,
    v_cache, slots), (k_blocks, v_blocks, tables)."""
    from vmemkv.attention.variants import explicit_attention

    group, kv_heads, head_dim, dtype = 2, 2, 32, torch.float32
    generator, seqs, q, seq_lens = make_case(lens, group, kv_heads, head_dim, dtype, seed=seed)
    sinks = torch.randn(kv_heads * group, generator=generator) if with_sinks else None
    expected = torch.zeros(q.shape, dtype=torch.float64)
    for b, (k, v) in enumerate(seqs):
        if k.shape[0] == 0:
            continue
        first = max(0, k.shape[0] - window) if window else 0
        expected[b] = explicit_attention(q[b, :, None].double()[None], k[first:].transpose(0, 1)[None].double(),
                                         v[first:].transpose(0, 1)[None].double(), 0.3, None, softcap,
                                         sinks)[0, :, 0]
    if window:  # poison what lies behind each window
        seqs = [(k.clone(), v.clone()) for k, v in seqs]
        for k, v in seqs:
            k[:max(0, k.shape[0] - window)] = NAN
            v[:max(0, v.shape[0] - window)] = NAN
    slots = interleaved_slots(seqs, num_slots, 80, kv_heads, head_dim, dtype, "cpu", generator)
    blocks = shuffled_blocks(seqs, 16, kv_heads, head_dim, dtype, "cpu", generator)
    return q, seq_lens, sinks, expected, slots, blocks
