"""Batched decode attention (one SDPA call per run of consecutive slots, or per gathered block-table
batch) gives what the per-sequence path gives, reads only mapped pages, and leaves free slots
between running ones unread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leaks
from vmemkv import CacheConfig, KVCacheManager
from vmemkv.attention import BlockTableAttention, ContiguousAttention, SequenceSpan
from vmemkv.attention.slot_batch import (DecodeBatch, attend, call_cost_in_rows, slot_runs,
                                         worth_batching)
from vmemkv.memory.vmm.cpu import CpuBackend

CPU = torch.device("cpu")
LAYOUTS = ["token_major", "per_layer"]


def config(**overrides) -> CacheConfig:
    return CacheConfig(**{**dict(num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=64,
                                 max_num_seqs=8, max_model_len=256, dtype=torch.float32,
                                 tokens_per_page=8), **overrides})


def admit(manager, lengths: dict[int, int], prefill_slot: int | None = None) -> list[SequenceSpan]:
    """Requests in the given slots, each decoding one token after ``length`` cached ones, then a
    prefill span; the cached positions get random K/V."""
    spans = []
    for row, (slot, cached) in enumerate(lengths.items()):
        manager.admit(str(slot), list(range(1, cached + 2)), slot=slot)
        spans.append(SequenceSpan(slot, row, 1, cached, tuple(manager.block_table(str(slot)))))
    manager.admit("p", list(range(1, 12)), slot=prefill_slot)
    spans.append(SequenceSpan(manager.slot_of("p"), len(spans), 11, 0, tuple(manager.block_table("p"))))
    generator = torch.Generator().manual_seed(0)
    for req in manager.request_ids():
        for layer in range(manager.layout.num_layers):
            for view in manager.kv_views(layer) if manager.config.kv_backend == "vmem" else ():
                rows = view[manager.slot_of(req), :manager.num_tokens(req)]
                rows.copy_(torch.randn(rows.shape, generator=generator))
    return spans


def run_both(manager, spans, make):
    total = spans[-1].query_start + spans[-1].num_queries
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, h, total, 32, generator=generator) for h in (8, 2, 2))
    out = []
    for batched in (False, True):
        attention = make(batched)
        out.append(torch.cat([attention(layer, query, key, value, None) for layer in range(2)]))
    return attention, out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_of_slots_with_a_gap_match_the_per_sequence_path(layout):
    manager = KVCacheManager(config(layout=layout))
    try:
        # slots 0-2 and 4-5 decode; slot 3 is free and was never mapped: it must not be read
        spans = admit(manager, {0: 5, 1: 40, 2: 17, 4: 100, 5: 3}, prefill_slot=6)
        manager.check()
        attention, (expected, got) = run_both(manager, spans, lambda batched: ContiguousAttention(
            spans, manager.kv_views, CPU, reads=manager.batched_reads() if batched else None))
        assert [b.members for b in attention.batches] == [[0, 1, 2], [3, 4]]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # slot 3 (free) was never mapped; filler pages let slot 5 be read up to 101 tokens
        assert (manager.slots.mapped_blocks(3, 1) < 0).all()
        assert manager.slots.stats.pages_filled > 0
        assert not manager.slots._read_pins  # released after the last layer
        assert_no_leaks(manager)
    finally:
        manager.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_grows_over_filler_pages_with_its_own_blocks(layout):
    manager = KVCacheManager(config(layout=layout))
    try:
        spans = admit(manager, {0: 3, 1: 60})
        ContiguousAttention(spans, manager.kv_views, CPU, reads=manager.batched_reads())
        manager.slots.release_reads()
        # slot 0 is readable to 61 tokens: per tensor (one for token-major, 2 x layers for
        # per-layer), the physical page behind each logical page up to there
        pages = manager.layout.logical_pages_for(61)
        filled = manager.slots.mapped_blocks(0, pages).reshape(manager.layout.pages_per_block, pages)
        assert (filled >= 0).all()
        own = len(manager.block_table("0"))
        pool_pages = manager.pool.num_blocks * manager.layout.pages_per_block
        assert (filled[:, :own] < pool_pages).all()  # its own blocks
        assert (filled[:, own:] >= pool_pages).all()  # filler pages: past the pool, no one's
        for _ in range(40):  # request "0" grows into the filler positions
            assert manager.allocate("0", 1, [7])
            manager.commit("0")
        manager.check()  # its slot maps exactly its own blocks
        assert_no_leaks(manager)
    finally:
        manager.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_filler_refused_by_the_mapping_budget_reads_per_sequence_and_changes_nothing(layout):
    """make_readable is all or nothing: when the mapping budget refuses the filler, no page is
    mapped or pinned and the step's decodes are read one call per sequence, exactly."""
    cache = config(layout=layout)
    page_layout = cache.make_layout()
    backend = CpuBackend(page_layout.page_size,
                         (cache.num_blocks + page_layout.logical_pages_for(cache.max_model_len))
                         * page_layout.pages_per_block, max_mappings=1000)
    manager = KVCacheManager(cache, backend=backend)
    try:
        spans = admit(manager, {0: 5, 1: 40, 2: 17})
        table = manager.slots.page_table.copy()
        backend.max_mappings = backend.mappings_in_use  # no kernel mapping to spare
        attention, (expected, got) = run_both(manager, spans, lambda batched: ContiguousAttention(
            spans, manager.kv_views, CPU, reads=manager.batched_reads() if batched else None))
        assert attention.batches == []  # refused: per-sequence calls
        assert (manager.slots.page_table == table).all()
        assert manager.slots.stats.pages_filled == 0 and not manager.slots._read_pins
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        backend.max_mappings = 1000  # with room again, the same step batches
        attention, (_, batched) = run_both(manager, spans, lambda batched: ContiguousAttention(
            spans, manager.kv_views, CPU, reads=manager.batched_reads()))
        assert [b.members for b in attention.batches] == [[0, 1, 2]]
        torch.testing.assert_close(batched, expected, rtol=1e-5, atol=1e-5)
        manager.check()
        assert_no_leaks(manager)
    finally:
        manager.close()


@pytest.mark.parametrize("slot_lengths,first_row", [
    ({0: 5, 1: 40, 2: 17}, 0),  # rows in slot order: queries sliced, not gathered
    ({2: 17, 0: 5, 1: 40}, None),  # rows out of slot order: gathered by index
])
def test_batch_rows_sliced_or_gathered_match_the_per_sequence_path(slot_lengths, first_row):
    manager = KVCacheManager(config())
    try:
        spans = admit(manager, slot_lengths)
        attention, (expected, got) = run_both(manager, spans, lambda batched: ContiguousAttention(
            spans, manager.kv_views, CPU, reads=manager.batched_reads() if batched else None))
        [batch] = attention.batches
        assert batch.first_row == first_row
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        del attention, batch
        assert_no_leaks(manager)
    finally:
        manager.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_tables_gather_decodes_into_one_call(layout):
    manager = KVCacheManager(config(kv_backend="paged", layout=layout))
    try:
        spans = admit(manager, {0: 5, 2: 40, 5: 17})  # any slots: the gather needs no order
        for layer in range(2):
            for view in manager.block_views(layer):
                view.copy_(torch.randn_like(view))
        del view  # close() refuses while a view is held

        class PerSequence(BlockTableAttention):
            def plan_batches(self):
                return []

        attention, (expected, got) = run_both(manager, spans, lambda batched: (
            BlockTableAttention if batched else PerSequence)(
                spans, manager.block_views, manager.tokens_per_page, CPU))
        assert [b.members for b in attention.batches] == [[0, 1, 2]]
        assert attention.copy_seconds > 0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        manager.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_additive_mask_gives_sdpa_bit_for_bit_what_the_bool_mask_gives(dtype):
    spans = [SequenceSpan(slot, slot, 1, cached) for slot, cached in enumerate([5, 40, 17])]
    batch = DecodeBatch([0, 1, 2], read_len=41, lo=0)
    batch.finish(spans, CPU)
    assert batch.mask is not None and not batch.same_length
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 3, 32, generator=generator).to(dtype)
    k, v = (torch.randn(3, 41, 2, 32, generator=generator).to(dtype) for _ in range(2))
    additive = batch.sdpa_mask(batch.mask, dtype)
    assert additive.dtype == dtype and batch.sdpa_mask(batch.mask, dtype) is additive  # once a step
    assert torch.equal(additive == 0, batch.mask) and torch.isneginf(additive[~batch.mask]).all()
    other = torch.ones(3, 1, 1, 41, dtype=torch.bool)
    assert batch.sdpa_mask(other, dtype) is other and batch.sdpa_mask(None, dtype) is None
    got = attend(query, k, v, batch.mask, batch, 32 ** -0.5, None)  # through the additive mask
    q = query[0].transpose(0, 1).reshape(3, 2, 4, 32)
    expected = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=batch.mask, scale=32 ** -0.5)
    assert torch.equal(got, expected.reshape(1, 3, 8, 32))


def test_batching_rules():
    spans = [SequenceSpan(slot, i, 1, 10) for i, slot in enumerate([4, 0, 1, 7, 2])]
    spans.append(SequenceSpan(3, 5, 4, 0))  # a prefill in slot 3 splits the runs
    assert slot_runs(spans) == [[1, 2, 4], [0], [3]]
    tiny, smollm2 = 2 * 32, 3 * 64  # kv_heads x head_dim
    assert worth_batching([100, 120, 90], tiny)
    assert not worth_batching([100], tiny)
    assert not worth_batching([10, 10, 10, 5000], tiny)  # padding to the longest would cost more
    # Wider rows make padding dearer against a call: ~50 rows of padding per sequence pays on
    # tiny-llama's shape, not on SmolLM2's (where the two measured a tie).
    lengths = [83 + i * 115 // 31 for i in range(32)]  # 83..198
    assert worth_batching(lengths, tiny)
    assert not worth_batching(lengths, smollm2)
    assert worth_batching([128] * 31 + [140], smollm2)  # little padding: batch on either shape
    assert call_cost_in_rows(tiny) > call_cost_in_rows(smollm2) >= 1
    assert call_cost_in_rows(10 ** 6) == 1


@pytest.mark.parametrize("attention", ["sdpa", "native"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_engine_with_gaps_between_running_slots_matches_hf(kv_backend, layout, attention):
    """Requests finish at different times (gaps open below running slots) and late requests fill
    the lowest free slots: greedy tokens still equal Hugging Face generate, with decodes read in
    batches by SDPA or all at once by the native routine."""
    from test_engine_correctness import NEW_TOKENS, assert_clean, hf_greedy, make_engine, prompts
    from vmemkv.engine import SamplingParams

    engine = make_engine(kv_backend=kv_backend, tokens_per_page=4, layout=layout, attention=attention)
    assert engine.manager.layout.kind == layout and engine.attention_kernel == attention
    token_prompts = prompts(10)
    limits = [3, NEW_TOKENS, 5, NEW_TOKENS, 2, NEW_TOKENS, 7, NEW_TOKENS, NEW_TOKENS, NEW_TOKENS]
    final, added, slots_seen = {}, 0, []
    while added < len(token_prompts) or engine.has_unfinished_requests():
        if added < len(token_prompts) and (added < 6 or engine.num_steps % 3 == 0):
            params = SamplingParams(max_tokens=limits[added], temperature=0, ignore_eos=True)
            engine.add_request(str(added), token_prompts[added], params)
            added += 1
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        slots_seen.append(sorted(engine.manager.slot_of(s.seq_id) for s in engine.scheduler.running))
    for index, prompt in enumerate(token_prompts):
        expected = hf_greedy("tiny-llama", tuple(prompt))[:limits[index]]
        assert final[str(index)].outputs[0].token_ids == expected, f"request {index} diverged"
    assert any(s and s[-1] + 1 > len(s) for s in slots_seen), "no step ran with a gap"
    if attention == "native":  # decodes read in place, whatever the gaps: no filler pages
        assert engine.decode_kernel
        assert kv_backend == "paged" or engine.manager.slots.stats.pages_filled == 0
    elif kv_backend == "vmem":
        assert engine.manager.slots.stats.pages_filled > 0  # batched reads happened
    else:
        assert engine.stats()["attention_copy_seconds"] > 0
    assert_clean(engine)
    engine.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_slot_whose_pages_were_unmapped_is_made_readable_again(layout):
    """make_readable remembers how far each slot is mapped, so an unchanged run costs no page
    table lookup; whatever unmaps a slot's pages or moves its window start back forgets it."""
    manager = KVCacheManager(config(layout=layout))
    slots = manager.slots
    try:
        admit(manager, {0: 5, 1: 40, 2: 17})

        def readable(run: list[int], num_tokens: int) -> bool:
            pages = slots._readable_pages(np.asarray(run), manager.layout.logical_pages_for(num_tokens))
            return bool((slots.page_table[pages] >= 0).all())

        assert slots.make_readable([0, 1, 2], 41) and readable([0, 1, 2], 41)
        slots.release_reads()
        filled = slots.stats.pages_filled
        assert slots.make_readable([0, 1, 2], 41)  # remembered: nothing mapped again
        assert slots.stats.pages_filled == filled
        slots.release_reads()
        slots.reclaim_stale({0: 1, 1: 6, 2: 3})  # unmaps the filler past each request's pages
        assert not readable([0, 1, 2], 41)
        assert slots.make_readable([0, 1, 2], 41) and readable([0, 1, 2], 41)
        assert slots.stats.pages_filled > filled
        slots.release_reads()
        # slot 1's first pages go behind its window, then the slot is given back: its next
        # request reads from position 0, whose pages are unmapped
        slots.release_behind(1, 2)
        assert slots.make_readable([0, 1, 2], 41)
        slots.release_reads()
        slots.release(1)
        slots.bind(slot=1)
        assert not readable([0, 1, 2], 41)
        assert slots.make_readable([0, 1, 2], 41) and readable([0, 1, 2], 41)
        slots.release_reads()
    finally:
        manager.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_make_readable_is_exact_under_random_unmaps_and_rebinds(layout):
    """A seeded random run of the mapper's operations: after every make_readable that says yes,
    every page the batched read touches is mapped."""
    rng = np.random.default_rng(0)
    manager = KVCacheManager(config(layout=layout, max_num_seqs=4))
    slots, layout_ = manager.slots, manager.layout
    try:
        bound = {slot: slots.bind(slot=slot) for slot in range(4)}
        for _ in range(300):
            op = rng.integers(5)
            slot = int(rng.integers(4))
            if op == 0:  # a run of consecutive bound slots read up to some length
                run = [s for s in range(slot, 4) if s in bound][:int(rng.integers(1, 5))]
                run = run[:next((i for i, s in enumerate(run) if s != run[0] + i), len(run))]
                num_tokens = int(rng.integers(1, 256))
                if run and slots.make_readable(run, num_tokens):
                    pages = slots._readable_pages(np.asarray(run), layout_.logical_pages_for(num_tokens))
                    assert (slots.page_table[pages] >= 0).all()
                slots.release_reads()
            elif op == 1:
                slots.reclaim_stale({s: int(rng.integers(0, 8)) for s in bound if rng.random() < 0.7})
            elif op == 2 and slot in bound:
                slots.release_behind(slot, int(rng.integers(0, 6)))
            elif op == 3 and slot in bound:
                slots.release(slot)
                del bound[slot]
            elif op == 4 and slot not in bound:
                bound[slot] = slots.bind(slot=slot)
    finally:
        manager.close()
