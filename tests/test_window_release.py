"""Blocks behind a sliding window go back to the pool while the request runs
(``CacheConfig.sliding_window``): the manager's rules, exact block ids, windowed prefix hits, the
window-aware accounting, the metric, and the engine on a tiny Mistral whose window is shorter
than its output (Hugging Face's greedy tokens with release on: chunked prefill, a prefix hit,
preemption by swap and recompute, both KV backends; a long generation holds at most the window
plus two blocks). The random walks over every manager path with released blocks are the
windowed machines of ``test_manager_state_machine.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig

from vmemkv import CacheConfig, ConfigError, KVCacheManager, KVRequest, RequestStateError
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.core.metrics import EngineMetrics
from vmemkv.engine.models.zoo import byte_tokenizer
from vmemkv.engine.models.hf_support import cache_config_for, uniform_window
from vmemkv.cache.request import RELEASED
from vmemkv.cache.window import first_needed_block, peak_blocks, windowed_prefix_hits

from conftest import assert_no_leaks, close_manager, read_kv_matches, write_kv
from test_vmm_cuda import fake  # noqa: F401 -- the fake CUDA driver fixture

P = 4  # tokens per block
W = 6  # the window in the manager tests


def make_manager(**overrides) -> KVCacheManager:
    options = dict(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32, tokens_per_page=P,
                   num_blocks=12, max_num_seqs=3, max_model_len=64, sliding_window=W,
                   swap_space_bytes=8 * 2 * 2 * 128 * 4 * P, hash_seed=b"window")
    return KVCacheManager(CacheConfig(**{**options, **overrides}))


def run(m: KVCacheManager, request_id: str, token_ids: list[int]) -> KVRequest:
    """Admit, write K/V of the uncached positions through the slot views, commit."""
    req = KVRequest(request_id, list(token_ids))
    cached = m.admit(req)
    assert cached is not None
    write_kv(m, request_id, cached, req.num_tokens)
    m.commit(req)
    return req


def decode(m: KVCacheManager, req: KVRequest, token: int) -> None:
    req.token_ids.append(token)
    assert m.allocate(req, 1)
    write_kv(m, req.request_id, req.num_tokens - 1, req.num_tokens)
    m.commit(req)


def resident_reads_back(m: KVCacheManager, req: KVRequest) -> bool:
    return read_kv_matches(m, req.request_id, start=req.num_released_blocks * P)


# --- the manager ---------------------------------------------------------------------------------

def test_blocks_behind_the_next_query_s_window_are_released_at_commit():
    m = make_manager()
    req = run(m, "a", list(range(1, 11)))  # 10 tokens: the query at 10 reads 5..10, block 0 is behind
    assert req.block_table == (RELEASED, 1, 2) and req.num_released_blocks == 1
    assert m.pool.ref[0] == 0 and m.pool.hash_of[0] is not None  # back in the pool, still cached
    assert m.cache_stats().blocks_released_behind_window == 1
    assert m.snapshot_stats()["blocks_released_behind_window"] == 1
    assert (m.slots.mapped_blocks(req.slot, 1) == -1).all()  # unmapped: a stray read faults
    for token in range(30):
        decode(m, req, token)
        m.check()
        assert m.num_blocks_in_use <= -(-W // P) + 1  # the window's blocks and the one it writes
        assert resident_reads_back(m, req)
    assert req.num_released_blocks == first_needed_block(req.num_tokens, W, P) == (40 - W + 1) // P
    assert_no_leaks(m)
    close_manager(m)


def test_without_a_window_nothing_is_released():
    m = make_manager(sliding_window=None)
    req = run(m, "a", list(range(1, 30)))
    assert req.num_released_blocks == 0 and RELEASED not in req.block_table
    assert m.cache_stats().blocks_released_behind_window == 0
    m.free(req)
    close_manager(m)


def test_a_bad_window_is_a_config_error():
    for bad in (0, -3, 2.5, "6"):
        with pytest.raises(ConfigError, match="sliding_window"):
            make_manager(sliding_window=bad)


def test_a_chunked_prefill_releases_only_what_its_next_chunk_does_not_read():
    m = make_manager()
    req = KVRequest("a", list(range(1, 25)))
    assert m.admit(req, token_budget=9) == 0
    write_kv(m, "a", 0, 9)
    m.commit(req)
    # the next chunk's first query is at 9 and reads 4..9: block 0 goes, block 1 stays
    assert req.num_released_blocks == 1
    assert m.allocate(req, 8)
    write_kv(m, "a", 9, 17)
    m.commit(req)
    assert req.num_released_blocks == (17 - W + 1) // P == 3
    m.check()
    assert resident_reads_back(m, req)
    m.free(req)
    close_manager(m)


def test_a_windowed_prefix_hit_needs_only_the_blocks_its_window_reads():
    m = make_manager(num_blocks=8)
    prompt = list(range(1, 21))  # 5 blocks
    a = run(m, "a", prompt)
    assert a.block_table == (RELEASED, RELEASED, RELEASED, 3, 4)  # released oldest first
    m.free(a)
    assert m.pool.free_queue()[:3] == [0, 1, 2]  # the LRU queue evicts the earliest first
    filler = run(m, "b", [99] * 13)  # 4 blocks: the 3 clean ones and the oldest cached, block 0
    assert m.pool.hash_of[0] != a.block_hashes[0]
    m.free(filler)
    again = prompt + [7]
    hits, _ = m.match_prefix(again)
    # 5 blocks hit: the query at 20 reads 15..20, blocks 3 and 4; blocks 0-2 need not be cached
    assert hits == [RELEASED, RELEASED, RELEASED, 3, 4]
    c = KVRequest("c", again)
    assert m.admit(c) == 20 and c.block_table[:5] == (RELEASED, RELEASED, RELEASED, 3, 4)
    assert resident_reads_back(m, c)  # the cached window, bit-exact
    write_kv(m, "c", 20, 21)
    m.commit(c)
    assert c.block_table[:5] == (RELEASED,) * 4 + (4,)  # the query at 21 reads 16..21
    assert resident_reads_back(m, c)
    m.check()
    m.free(c)
    close_manager(m)


def test_a_windowed_prefix_is_no_hit_when_a_block_its_window_reads_is_gone():
    m = make_manager(num_blocks=8)
    prompt = list(range(1, 21))
    a = run(m, "a", prompt)
    m.free(a)  # LRU: 0 1 2 (released) then 4 3 (freed deepest first)
    filler = run(m, "b", [99] * 25)  # 7 blocks: evicts 0, 1, 2 and 4
    m.free(filler)
    hits, _ = m.match_prefix(prompt + [7])
    assert RELEASED not in hits and len(hits) <= 1  # block 3 alone is no usable window
    close_manager(m)


@given(cached=st.lists(st.booleans(), max_size=12), window=st.integers(1, 14))
def test_windowed_prefix_hits_against_brute_force(cached, window):
    hits, first = windowed_prefix_hits(len(cached), lambda i: cached[i], window, P)
    best = max(h for h in range(len(cached) + 1)
               if all(cached[max(0, h * P - window + 1) // P: h]))
    assert (hits, first) == (best, max(0, best * P - window + 1) // P if best else 0)


def test_fork_swap_and_recompute_keep_released_blocks_released():
    m = make_manager()
    a = run(m, "a", list(range(1, 15)))
    child = m.fork(a, "a/1")
    assert child.block_table[: a.num_released_blocks] == (RELEASED,) * a.num_released_blocks
    assert child.num_released_blocks == a.num_released_blocks == 2
    decode(m, child, 5)
    assert m.preempt(child, "swap") == "swap"
    assert m.swap_in(child)
    m.check()
    assert resident_reads_back(m, child) and resident_reads_back(m, a)
    assert m.preempt(a, "recompute") == "recompute"
    assert m.admit(a) == 12  # its window's blocks are still cached
    m.check()
    assert_no_leaks(m)
    close_manager(m)


def test_truncating_behind_the_window_is_refused_and_changes_nothing():
    m = make_manager()
    req = run(m, "a", list(range(1, 21)))
    before = (req.block_table, list(req.token_ids), m.num_free_blocks)
    with pytest.raises(RequestStateError, match="released behind its sliding window"):
        m.truncate(req, 8)
    assert (req.block_table, list(req.token_ids), m.num_free_blocks) == before
    assert m.truncate(req, 18)  # the query at 18 reads 13..18: still resident
    m.check()
    m.free(req)
    close_manager(m)


def test_blocks_for_tokens_counts_the_window_and_a_chunk():
    m = make_manager()
    assert m.blocks_for_tokens(40) == 10  # computed all at once: every block
    assert m.blocks_for_tokens(40, 1) == peak_blocks(40, 1, W, P) == 3  # 6 tokens span <= 3 blocks
    assert m.blocks_for_tokens(40, 8) == 4  # 5 tokens of window + 8 of chunk
    assert m.blocks_for_tokens(3, 8) == 1
    assert m.why_never_fits(64, 1) is None and "need 16 KV blocks" in m.why_never_fits(64)
    small = make_manager(num_blocks=4)
    assert small.why_never_fits(60) is not None and small.why_never_fits(60, 1) is None
    close_manager(small)
    close_manager(m)


def test_the_released_blocks_metric():
    m = make_manager()
    metrics = EngineMetrics(cache_stats=m.cache_stats)
    req = run(m, "a", list(range(1, 21)))
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}
    assert samples["vmemkv_kv_blocks_released_behind_window_total"] == req.num_released_blocks == 3
    m.free(req)
    close_manager(m)


# --- the Hugging Face adapter --------------------------------------------------------------------

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=256, eos_token_id=None, pad_token_id=0, initializer_range=0.2)


def mistral(window: int = 8) -> torch.nn.Module:
    """Four layers: 1 KiB of K/V a token, so a 4 KiB page holds P = 4 tokens."""
    torch.manual_seed(0)
    config = MistralConfig(**{**SHAPE, "num_hidden_layers": 4}, sliding_window=window)
    return AutoModelForCausalLM.from_config(config).eval()


def test_cache_config_for_releases_only_when_every_layer_slides_with_one_window():
    model = mistral(8)
    assert uniform_window(model.config) == 8
    assert cache_config_for(model, 2, 64, release_behind_window=True).sliding_window == 8
    assert cache_config_for(model, 2, 64).sliding_window is None  # VmemkvCache reads every token
    assert cache_config_for(model, 2, 8, release_behind_window=True).sliding_window is None
    gemma = Gemma2Config(**SHAPE, sliding_window=8, head_dim=16)  # local and global layers
    assert uniform_window(gemma) is None


# --- the engine ------------------------------------------------------------------------------------

NEW_TOKENS = 40


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(lengths) -> list[list[int]]:
    return [[(31 * i + 7 * j) % 250 + 1 for j in range(length)] for i, length in enumerate(lengths)]


def run_engine(batch, new_tokens: int = NEW_TOKENS, **config):
    options = dict(max_num_seqs=4, max_model_len=96, tokens_per_page=P, swap_space_bytes=1 << 20)
    engine = LLMEngine(EngineConfig(**{**options, **config}), model=mistral(), tokenizer=byte_tokenizer())
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(batch)])
    return engine, [final[str(i)].outputs[0].token_ids for i in range(len(batch))]


def close_clean(engine: LLMEngine) -> None:
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0
    engine.close()


@pytest.fixture(scope="module")
def reference():
    model = mistral()
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_engine_with_release_matches_hf_with_chunked_prefill(reference, kv_backend):
    batch = prompts((3, 13, 22, 9))
    engine, got = run_engine(batch, kv_backend=kv_backend, max_num_batched_tokens=8)
    assert engine.manager.config.sliding_window == 8 and engine.manager.tokens_per_page == P
    assert engine.manager.cache_stats().blocks_released_behind_window > 0
    assert got == [hf_greedy(reference, p) for p in batch]
    close_clean(engine)


def test_engine_with_release_matches_hf_on_a_prefix_hit(reference):
    system = prompts((16,))[0]
    batch = [system + [5, 9], system + [7, 7, 7]]
    engine, first = run_engine(batch[:1])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [("b", batch[1], params)])
    assert final["b"].num_cached_tokens == 16  # four blocks; the window needed blocks 2 and 3
    assert first + [final["b"].outputs[0].token_ids] == [hf_greedy(reference, p) for p in batch]
    close_clean(engine)


@pytest.mark.parametrize("mode,kv_backend", [("swap", "vmem"), ("recompute", "vmem"), ("swap", "paged")])
def test_engine_with_release_matches_hf_under_preemption(reference, mode, kv_backend):
    # 9 blocks: the 4 prompts fit (2 blocks each), their windows (3 blocks each) do not
    batch = prompts((5, 6, 7, 5))
    engine, got = run_engine(batch, kv_backend=kv_backend, num_blocks=9, preemption_mode=mode,
                             enable_prefix_caching=False, watermark=0.0)
    assert engine.scheduler.num_preemptions > 0
    assert engine.manager.cache_stats().blocks_released_behind_window > 0
    assert got == [hf_greedy(reference, p) for p in batch]
    close_clean(engine)


def test_a_long_generation_holds_at_most_the_window_plus_two_blocks(reference):
    """80 tokens through a window of 8 (two 4-token blocks): the request never holds more than
    four blocks, where keeping everything would take 21; and it runs in a pool of 5 blocks,
    where its whole length would never fit."""
    prompt = prompts((5,))[0]
    engine = LLMEngine(EngineConfig(max_num_seqs=1, max_model_len=96, tokens_per_page=P, num_blocks=5,
                                    max_num_batched_tokens=8),
                       model=mistral(), tokenizer=byte_tokenizer())
    engine.add_request("a", prompt, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, engine.manager.num_blocks_in_use)
    assert peak <= 8 // P + 2
    assert outputs[-1].outputs[0].token_ids == hf_greedy(reference, prompt, 80)
    close_clean(engine)


# --- the hole page (CUDA) ---------------------------------------------------------------------------

def test_pages_behind_the_window_point_at_the_hole_page_where_the_backend_needs_them_mapped():
    """On CUDA, FlashAttention may load a tile before the window start, so released pages point
    at one shared hole page instead of being unmapped (shown here on the CPU backend, which maps
    one page at many addresses as cuMemMap does)."""
    from vmemkv.memory.slot_mapper import SlotMapper
    from vmemkv.memory.vmm import CpuBackend

    config = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32,
                         tokens_per_page=P, num_blocks=12, max_num_seqs=2, max_model_len=64)
    layout = config.make_layout()
    backend = CpuBackend(layout.page_size, 13)
    backend.pool_window()[12].fill_(0xFF)  # NaN bytes: the mapper must clear them
    slots = SlotMapper(backend, layout, 2, 64, 12, hole_page=12)
    slot = slots.bind()
    slots.map_blocks(slot, 0, [3, 4, 5, 6])
    slots.release_behind(slot, 2)
    assert slots.mapped_blocks(slot, 4).tolist() == [12, 12, 5, 6]
    slots.check_request(slot, [RELEASED, RELEASED, 5, 6], num_released=2)
    views = slots.kv_views(0)
    assert torch.equal(views[0][slot, 0], views[0][slot, P])  # both read the one hole page
    assert not views[0][slot, :2 * P].any()  # zeroed: masked rows times 0 stay 0
    del views
    slots.close()
    backend.close()


def test_a_windowed_manager_on_cuda_reserves_a_hole_page(fake):
    """On the fake CUDA driver of ``test_vmm_cuda.py``."""
    m = KVCacheManager(CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                                   num_blocks=6, max_num_seqs=2, max_model_len=4096, device="cuda",
                                   sliding_window=100, hash_seed=b"w"))
    hole = m.slots.hole_page
    assert hole == 6 and m.backend.num_pages == 7  # past the pool: no request owns it
    size = m.tokens_per_page
    req = KVRequest("a", list(range(1, size + 110)))
    assert m.admit(req) == 0
    m.commit(req)
    assert req.num_released_blocks == 1
    assert m.slots.mapped_blocks(req.slot, 1).tolist() == [hole]
    m.check()
    m.free(req)
    m.close()


@pytest.mark.parametrize("kind", ["sdpa", "flash"])
def test_the_block_table_a_kernel_gets_for_released_blocks(kind):
    """The block-table baseline's spans keep RELEASED (-1) where reads start at the window (a
    stray read of it fails); FlashAttention, which may load a tile before the window start, gets
    the request's first held block there in its arguments (written K/V, finite; masked rows)."""
    from vmemkv.attention.choice import AttentionChoice
    from vmemkv.attention.flash_args import block_varlen_args
    from vmemkv.engine.core.addressing import BlockTableAddressing

    m = make_manager(kv_backend="paged")
    req = KVRequest("a", list(range(1, 21)))
    m.admit(req)
    m.commit(req)  # no K/V written: only the tables matter here
    choice = AttentionChoice("flash", kernel=object()) if kind == "flash" else AttentionChoice("sdpa")
    addressing = BlockTableAddressing(m, torch.device("cpu"), choice)
    span = addressing.span(req, 0, 1, req.num_computed_tokens - 1)  # its last token's query
    assert span.block_table == (RELEASED,) * 3 + req.block_table[3:]
    if kind == "flash":
        table = block_varlen_args([span], m.tokens_per_page).block_table[0]
        assert table == [req.block_table[3]] * 3 + list(req.block_table[3:])
    m.free(req)
    close_manager(m)
