"""One mixed step over a real manager, shared by the CPU and GPU FlashAttention tests: a prefill,
a chunked prefill (queries after cached tokens) and two decodes, packed in an order that is not
slot order, with GQA 4:1."""

from __future__ import annotations

import torch

from vmemkv import CacheConfig, KVCacheManager
from vmemkv.attention import BlockTableAttention, ContiguousAttention, SequenceSpan

# (new tokens this step, tokens already cached): prefill, chunked prefill, decode, decode
CASES = [(7, 0), (5, 9), (1, 20), (1, 3)]
PACKED_ORDER = (2, 0, 3, 1)  # case index packed first, second, ...: not slot order
GQA = 4  # query heads per kv head


def history_attention(manager: KVCacheManager, spans: list[SequenceSpan], device):
    """An attention object whose ``write`` stores the given spans' tokens (either addressing)."""
    if manager.config.kv_backend == "paged":
        return BlockTableAttention(spans, manager.block_views, manager.tokens_per_page, device)
    return ContiguousAttention(spans, manager.kv_views, device)


def mixed_step(manager: KVCacheManager, dtype: torch.dtype, seed: int = 0, device="cpu"):
    """Admit one request per case, write its cached tokens' K/V in every layer, and return the
    step's spans and its ``query``/``key``/``value`` ``[1, H, T, D]``."""
    generator = torch.Generator().manual_seed(seed)
    layout = manager.layout
    paged = manager.config.kv_backend == "paged"
    slots, tables = [], []
    for index, (new, cached) in enumerate(CASES):
        request = f"case{index}"
        manager.admit(request, [(7 * index + j) % 50 + 1 for j in range(new + cached)])
        slots.append(manager.slot_of(request))
        tables.append(tuple(manager.block_table(request)) if paged else ())
    history = [SequenceSpan(slots[i], 0, cached, 0, tables[i]) for i, (_, cached) in enumerate(CASES)]
    for span in history:
        if span.num_queries == 0:
            continue
        writer = history_attention(manager, [span], device)
        for layer in range(layout.num_layers):
            shape = (span.num_queries, layout.num_kv_heads, layout.head_dim)
            writer.write(layer, torch.randn(shape, generator=generator).to(device, dtype),
                         torch.randn(shape, generator=generator).to(device, dtype))
    spans, start = [], 0
    for index in PACKED_ORDER:
        new, cached = CASES[index]
        spans.append(SequenceSpan(slots[index], start, new, cached, tables[index]))
        start += new
    heads = (GQA * layout.num_kv_heads, layout.num_kv_heads, layout.num_kv_heads)
    query, key, value = (torch.randn(1, h, start, layout.head_dim, generator=generator).to(device, dtype)
                         for h in heads)
    return spans, query, key, value


def free_cases(manager: KVCacheManager) -> None:
    for index in range(len(CASES)):
        manager.free(f"case{index}")


def case_manager(**config):
    """A float64 manager shaped for ``mixed_step`` (2 layers, 2 kv heads of 16, 6 slots of 44
    tokens), for a pytest fixture: ``yield from``; checked and closed afterwards."""
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float64, num_blocks=40,
                 max_num_seqs=6, max_model_len=44)
    manager = KVCacheManager(CacheConfig(**{**shape, **config}))
    yield manager
    free_cases(manager)
    manager.check()
    manager.close()
