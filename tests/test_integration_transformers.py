"""``VmemkvCache`` in ``model.generate()`` gives the same tokens as transformers' ``DynamicCache``:
greedy, seeded sampling, left padding, beam search (reordered by remapping pages), and prefix
reuse across calls (which computes fewer tokens). After every test the manager's invariants hold
and, once the cache is released, no page is held. Sliding-window layers (tiny Gemma-2, Gemma-3,
Mistral, window 3) hold at most the window's pages plus two on every decode step, answer
``get_mask_sizes`` as ``DynamicSlidingWindowLayer``, and still give DynamicCache's tokens, greedy,
padded and with beams."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vmemkv.engine.models.hf_support import layer_kinds
from vmemkv_transformers import VmemkvCache, cache_kwarg, manager_for
from vmemkv.errors import ConfigError, InvalidInputError
from vmemkv.memory.slots import NoFreeSlotError

VOCAB = 512
PAD = 0


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    # A fresh config object per model: models built from one config share it.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def cache(model):
    cache = VmemkvCache.from_model(model, max_batch_size=8, max_cache_len=256)
    yield cache
    cache.manager.check()
    cache.release()
    cache.manager.check()
    assert cache.manager.num_blocks_in_use == 0
    cache.close()


class TokenCounter:
    """Counts the token positions the model computes (a forward pre-hook)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.tokens += kwargs["input_ids"].numel()

    def close(self) -> None:
        self.handle.remove()


def generate(model, ids, cache=None, **kwargs) -> torch.Tensor:
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    return model.generate(ids, **kwargs)


def test_greedy_matches_dynamic_cache(model, cache):
    ids = torch.cat([prompt(37, 1), prompt(37, 2)])
    want = generate(model, ids, max_new_tokens=24, do_sample=False)
    got = generate(model, ids, cache, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    # the returned views cover exactly the positions written: prompt + all but the last token
    assert cache.get_seq_length() == 37 + 23
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert keys.shape == (2, 2, 60, 32) and values.shape == (2, 2, 60, 32)
    assert not keys.is_contiguous()  # a strided view of the slots, not a copy ...
    slots = cache.manager.kv_views(0)[0]
    assert keys.untyped_storage().data_ptr() == slots.untyped_storage().data_ptr()  # ... of them
    assert keys.stride()[0] == slots.stride()[0]  # consecutive slots
    # each row's token ids live in its KVRequest alone: every id fed (all but the last sampled)
    assert [row.kv.token_ids for row in cache._rows] == got[:, :-1].tolist()
    cache.manager.check()


def test_views_equal_dynamic_cache_contents(model, cache):
    ids = prompt(21, 3)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): dynamic})
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    for layer in range(2):
        keys, values = cache.layer_views(layer)
        assert torch.equal(keys, dynamic.layers[layer].keys)
        assert torch.equal(values, dynamic.layers[layer].values)


def test_seeded_sampling_matches(model, cache):
    ids = prompt(29, 4)
    kwargs = {"max_new_tokens": 20, "do_sample": True, "top_k": 40, "temperature": 0.9,
              "num_return_sequences": 3}
    torch.manual_seed(123)
    want = generate(model, ids, **kwargs)
    torch.manual_seed(123)
    got = generate(model, ids, cache, **kwargs)
    assert torch.equal(got, want)
    # the rows are forks of the prompt's row, each with its own token list
    assert [row.kv.token_ids for row in cache._rows] == got[:, :-1].tolist()


def test_left_padding_matches(model, cache):
    lengths = [9, 30, 17]
    width = max(lengths)
    ids = torch.full((3, width), PAD)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = prompt(length, 10 + row)
        mask[row, width - length:] = 1
    want = generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = generate(model, ids, cache, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, want)
    # every row holds the same number of positions; padded ones are hidden by the mask
    assert {cache.manager.num_tokens(r) for r in cache.request_ids} == {width + 15}
    # padded rows are hashed under their padding pattern: an unpadded prompt with the same
    # token ids (pads included) does not hit their pages
    cache.release()
    assert cache.admit_prompt(ids[:1]) == 0
    cache.release()
    # ... while the same padded row does
    assert cache.admit_prompt(ids[:1], mask[:1]) == 16  # (30 - 1) // 16 full pages


@pytest.mark.parametrize("num_beams,num_return", [(4, 2), (4, 4)])
def test_beam_search_matches_and_remaps(model, cache, num_beams, num_return):
    ids = prompt(45, 5)
    kwargs = {"max_new_tokens": 20, "num_beams": num_beams, "num_return_sequences": num_return,
              "do_sample": False, "length_penalty": 1.0}
    want = generate(model, ids, **kwargs)
    reorders = []
    original = cache.manager.reorder
    cache.manager.reorder = lambda rows, sources: reorders.append(list(sources)) or original(rows, sources)
    got = generate(model, ids, cache, **kwargs)
    assert torch.equal(got, want)
    assert reorders, "beam search must reorder through the manager"
    # full pages are shared between beams, never copied: at most the partial page per row
    assert cache.manager.cache_stats().blocks_copied <= len(reorders) * num_beams
    tables = [cache.manager.block_table(r) for r in cache.request_ids]
    full = cache.get_seq_length() // cache.manager.tokens_per_page
    assert all(table[:2] == tables[0][:2] for table in tables)  # the prompt's full pages
    assert len({b for table in tables for b in table}) < num_beams * len(tables[0])
    assert full >= 2
    # reorders replaced each row's token list in place: the prompt, then its beam's ids
    for row in cache._rows:
        assert row.kv.token_ids[:45] == ids[0].tolist()
        assert len(row.kv.token_ids) == row.kv.num_computed_tokens == cache.get_seq_length()
    cache.manager.check()


def test_prefix_reuse_computes_fewer_tokens_and_matches(model, cache):
    shared = prompt(50, 6)
    first = torch.cat([shared, prompt(7, 7)], dim=1)
    second = torch.cat([shared, prompt(11, 8)], dim=1)
    kwargs = {"max_new_tokens": 12, "do_sample": False}

    counter = TokenCounter(model)
    try:
        want = generate(model, second, **kwargs)
        dynamic_tokens, counter.tokens = counter.tokens, 0
        cache.generate(first, **kwargs)
        assert cache.last_call["cached_tokens"] == 0
        counter.tokens = 0
        got = cache.generate(second, **kwargs)
        reuse_tokens = counter.tokens
    finally:
        counter.close()
    assert torch.equal(got, want)
    page = cache.manager.tokens_per_page
    cached = (50 // page) * page
    assert cache.last_call["cached_tokens"] == cached == 48
    assert dynamic_tokens == 61 + 11
    assert reuse_tokens == dynamic_tokens - cached
    assert cache.manager.num_blocks_in_use == 0  # generate() released its rows


def test_prefix_reuse_includes_generated_tokens(model, cache):
    first = prompt(20, 9)
    out = cache.generate(first, max_new_tokens=30, do_sample=False)
    follow_up = torch.cat([out, prompt(5, 10)], dim=1)  # a conversation turn: prompt + answer + more
    want = generate(model, follow_up, max_new_tokens=8, do_sample=False)
    got = cache.generate(follow_up, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    # the first call computed 20 + 29 positions; their 3 full pages are hits
    assert cache.last_call["cached_tokens"] == 48


def test_prefix_reuse_with_beams_and_padding(model, cache):
    shared = prompt(40, 11)
    cache.generate(torch.cat([shared, prompt(3, 12)], dim=1), max_new_tokens=4, do_sample=False)
    ids = torch.cat([shared, prompt(9, 13)], dim=1)
    kwargs = {"max_new_tokens": 12, "num_beams": 4, "num_return_sequences": 2, "do_sample": False}
    want = generate(model, ids, **kwargs)
    counter = TokenCounter(model)
    try:
        got = cache.generate(ids, **kwargs)
    finally:
        counter.close()
    assert torch.equal(got, want)
    assert cache.last_call["cached_tokens"] == 32
    # the uncached prompt tokens are computed once, not once per beam; then 4 beams x 12 steps
    assert counter.tokens == (49 - 32 - 1) + 4 * 12

    # a left-padded batch through the reuse path
    ids = torch.full((2, 30), PAD)
    mask = torch.zeros((2, 30), dtype=torch.long)
    ids[0, 10:], mask[0, 10:] = prompt(20, 14), 1
    ids[1], mask[1] = prompt(30, 15), 1
    want = generate(model, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    cache.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = cache.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    assert cache.last_call["cached_tokens"] == 2 * 16  # (30 - 1) // 16 full pages per row


def test_other_model_never_hits(model):
    other = tiny_llama(seed=1)
    manager = manager_for(model, max_batch_size=4, max_cache_len=128)
    try:
        ids = prompt(40, 16)
        first = VmemkvCache(manager, model)
        first.generate(ids, max_new_tokens=4, do_sample=False)
        second = VmemkvCache(manager, other)  # same shapes, other weights: other K/V
        want = generate(other, ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(second.generate(ids, max_new_tokens=6, do_sample=False), want)
        assert second.last_call["cached_tokens"] == 0
        # the same model through another cache on the manager does hit
        third = VmemkvCache(manager, model)
        third.generate(ids, max_new_tokens=4, do_sample=False)
        assert third.last_call["cached_tokens"] == 32
        manager.check()
        assert manager.num_blocks_in_use == 0
    finally:
        manager.close()


def test_unknown_token_ids_are_never_shared(model, cache):
    ids = prompt(40, 21)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    kwargs = {"inputs_embeds": embeds, "max_new_tokens": 8, "do_sample": False}
    want = generate(model, None, **kwargs)
    got = generate(model, None, cache, **kwargs)
    assert torch.equal(got, want)
    cache.release()
    assert cache.manager.num_cached_blocks > 0  # full pages were registered, under a random salt
    assert cache.admit_prompt(ids) == 0  # ... that no prompt can hit


def test_batch_select_and_repeat_interleave(model, cache):
    ids = torch.cat([prompt(19, 17), prompt(19, 18), prompt(19, 19)])
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): dynamic})
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    for op, arg in [("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([5, 0, 2])),
                    ("reorder_cache", torch.tensor([2, 2, 0]))]:
        getattr(dynamic, op)(arg)
        getattr(cache, op)(arg)
        cache.manager.check()
        for layer in range(2):
            keys, values = cache.layer_views(layer)
            assert torch.equal(keys, dynamic.layers[layer].keys), op
            assert torch.equal(values, dynamic.layers[layer].values), op
    # and decoding continues identically
    step = torch.tensor([[7], [8], [9]])
    with torch.no_grad():
        want = model(input_ids=step, use_cache=True, **{cache_kwarg(model): dynamic}).logits
        got = model(input_ids=step, use_cache=True, **{cache_kwarg(model): cache}).logits
    assert torch.equal(got, want)


def test_errors_are_clear(model, cache):
    with pytest.raises(NoFreeSlotError, match="consecutive free slots"):
        generate(model, prompt(8, 20).repeat(9, 1), cache, max_new_tokens=2, do_sample=False)
    cache.release()
    with pytest.raises(ConfigError, match="chunked attention of 8 tokens"):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, layer_types=["chunked_attention", "full_attention"],
                             attention_chunk_size=8)
        manager_for(LlamaForCausalLM(config), max_batch_size=1, max_cache_len=32)


def test_prompt_lookup_decoding_crops_and_matches(model, cache):
    # Prompt-lookup decoding proposes candidates copied from the prompt and crops the cache back
    # past the rejected ones: greedy output must still equal plain greedy decoding.
    motif = prompt(12, 7)
    ids = torch.cat([motif, prompt(9, 8), motif, prompt(5, 9)], dim=1)
    want = generate(model, ids, max_new_tokens=30, do_sample=False)
    crops = []
    original = cache.crop
    cache.crop = lambda max_length: (crops.append(max_length), original(max_length))[1]
    got = generate(model, ids, cache, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    assert crops, "prompt-lookup decoding never cropped the cache"
    cache.manager.check()


def test_crop_takes_a_count_given_as_a_tensor_as_transformers_5_17_gives_it(model, cache):
    # 5.17's assisted and prompt-lookup decoding crop by `-n_matches`, a 0-d integer tensor.
    generate(model, prompt(10, 3), cache, max_new_tokens=4, do_sample=False)
    length = cache.get_seq_length()
    cache.crop(torch.tensor(-2))
    assert cache.get_seq_length() == length - 2
    for bad in (torch.tensor([-1, -1]), torch.tensor(-1.0), torch.tensor(True)):
        with pytest.raises(InvalidInputError, match="one-element integer tensor"):
            cache.crop(bad)
    assert cache.get_seq_length() == length - 2
    cache.manager.check()


def test_crop_copies_a_shared_last_page(model):
    from vmemkv import CacheConfig, KVCacheManager

    manager = KVCacheManager(CacheConfig(num_layers=1, num_kv_heads=1, head_dim=128, num_blocks=8,
                                         max_num_seqs=2, max_model_len=64, dtype=torch.float32,
                                         tokens_per_page=4))  # 1 KiB a token, 4 KiB pages
    assert manager.tokens_per_page == 4
    tokens = list(range(10))
    manager.admit("a", tokens)
    slot = manager.slot_of("a")
    keys = manager.kv_views(0)[0]
    keys[slot, :10] = torch.arange(10.0)[:, None, None]
    manager.commit("a")
    full_pages = manager.block_table("a")[:2]
    assert manager.truncate("a", 6)  # the second page, hashed and full, becomes partial: copied
    assert manager.block_table("a")[0] == full_pages[0]
    assert manager.block_table("a")[1] != full_pages[1]
    assert manager.pool.hash_of[full_pages[1]] is not None  # the cached page keeps its content
    torch.testing.assert_close(keys[slot, :6, 0, 0], torch.arange(6.0))
    manager.check()
    assert manager.allocate("a", 2, [99, 98])
    keys[slot, 6:8] = -1.0
    manager.commit("a")
    manager.check()
    manager.admit("b", tokens)  # still hits both original pages, bytes unchanged
    assert manager.num_computed_tokens("b") == 8
    torch.testing.assert_close(keys[manager.slot_of("b"), :8, 0, 0], torch.arange(8.0))
    manager.free("a")
    manager.free("b")
    manager.check()
    del keys  # close() refuses while views are held
    manager.close()


# --- sliding-window layers keep O(window) blocks ---------------------------------------------------

WINDOW_MODELS = ["gemma2", "gemma3", "mistral"]  # local/global (hybrid groups), every layer local
# 4 KV heads x 32 dims in float32: 1 KiB a token and layer, so a 4 KiB page holds 4 tokens of one
# layer (each hybrid group holds one layer): a window of 3 spans at most 2 pages.
WIDE_KV = dict(num_key_value_heads=4, head_dim=32)


def window_model(name: str):
    from test_sliding_window_models import GEMMA, build

    extra = dict(query_pre_attn_scalar=32) if "gemma" in name else {}
    model = build(name, **WIDE_KV, **extra)
    assert GEMMA["head_dim"] != model.config.head_dim  # the override took
    model.generation_config.pad_token_id = 0
    return model


def local_blocks_held(cache) -> list[int]:
    """Blocks each row holds in its sliding layers' group (RELEASED entries do not count)."""
    groups = cache.manager.layout_groups
    local = next((group.index for group in groups if group.spec.releases), 0)  # the sliding group
    tables = [kv.group_block_table(local) for kv in (row.kv for row in cache._rows)]
    return [sum(block >= 0 for block in table) for table in tables]


class DecodeBlockWatch:
    """Before the model's last layer runs (the step's blocks are reserved, the last step's
    committed), the most local blocks any row holds on a decode step."""

    def __init__(self, model, cache):
        self.cache, self.most, self.decode_steps = cache, 0, 0
        self.handle = model.model.layers[-1].register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.cache._step_len == 1:
            self.decode_steps += 1
            self.most = max([self.most] + local_blocks_held(self.cache))

    def close(self) -> None:
        self.handle.remove()


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_sliding_layers_hold_the_window_and_match_dynamic_cache(name):
    from test_sliding_window_models import WINDOW

    model = window_model(name)
    ids = torch.cat([prompt(20, 11), prompt(20, 12)]) % 250 + 1
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False)
    want = generate(model, ids, **kwargs)
    with VmemkvCache.from_model(model, max_batch_size=2, max_cache_len=96, tokens_per_page=4) as cache:
        assert cache.manager.tokens_per_page == 4
        assert cache.is_sliding == [kind == "sliding_attention" for kind in layer_kinds(model.config)]
        watch = DecodeBlockWatch(model, cache)
        try:
            got = generate(model, ids, cache, **kwargs)
        finally:
            watch.close()
        assert torch.equal(got, want), name
        bound = -(-WINDOW // 4) + 2  # the window's pages plus two
        assert watch.decode_steps == 39 and 0 < watch.most <= bound
        # every layer keeping every token would hold all 60 positions: 15 blocks a row
        assert cache.get_seq_length() == 59 and -(-59 // 4) > 3 * bound
        assert cache.manager.cache_stats().blocks_released_behind_window > 0
        cache.manager.check()


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_sliding_layers_beam_search_matches_dynamic_cache(name):
    model = window_model(name)
    ids = prompt(18, 13) % 250 + 1
    kwargs = dict(max_new_tokens=24, num_beams=3, num_return_sequences=2, do_sample=False,
                  length_penalty=1.0)
    want = generate(model, ids, **kwargs)
    with VmemkvCache.from_model(model, max_batch_size=3, max_cache_len=64, tokens_per_page=4) as cache:
        reorders = []
        original = cache.manager.reorder
        cache.manager.reorder = lambda rows, sources: reorders.append(list(sources)) or original(rows, sources)
        got = generate(model, ids, cache, **kwargs)
        assert torch.equal(got, want), name
        assert reorders, "beam search must reorder through the manager"
        assert cache.manager.cache_stats().blocks_released_behind_window > 0
        cache.manager.check()


def test_mask_sizes_follow_dynamic_sliding_window_layer():
    """A sliding layer answers get_mask_sizes as transformers' DynamicSlidingWindowLayer does at
    every length (before and after the window fills), and a global layer gives every position."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = window_model("gemma2")
    with VmemkvCache.from_model(model, max_batch_size=1, max_cache_len=64, tokens_per_page=4) as cache:
        local = [i for i, layer in enumerate(cache.layers) if layer.is_sliding][0]
        glob = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding][0]
        reference = DynamicSlidingWindowLayer(sliding_window=model.config.sliding_window)
        heads, dim = model.config.num_key_value_heads, model.config.head_dim
        ids = prompt(12, 14) % 250 + 1
        for step, count in enumerate([5, 1, 1, 3, 1, 1]):
            start = cache.get_seq_length()
            assert cache.get_mask_sizes(count, local) == reference.get_mask_sizes(count), (step, start)
            assert cache.get_mask_sizes(count, glob) == (start + count, 0)
            cache.observe(ids[:, start:start + count])
            keys = torch.randn(1, heads, count, dim)
            for layer in range(len(cache.layers)):
                got_keys = cache.update(keys, keys, layer)[0]
                if layer == local:  # the positions the mask sizes announced, the same values
                    want_keys, _ = reference.update(keys, keys)
                    torch.testing.assert_close(got_keys, want_keys)
                del got_keys  # close() refuses while views are held


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_sliding_rows_start_from_one_prefix_hit(name):
    """Rows whose cached prefixes differ start at the shortest hit: a row that hit more would
    have released blocks behind its own window that the batch's first forward reads."""
    model = window_model(name)
    first = prompt(30, 15) % 250 + 1
    batch = torch.cat([torch.cat([first, prompt(4, 16) % 250 + 1], dim=1),
                       torch.cat([first[:, :14], prompt(20, 17) % 250 + 1], dim=1)])
    kwargs = dict(max_new_tokens=12, do_sample=False)
    want = generate(model, batch, **kwargs)
    with VmemkvCache.from_model(model, max_batch_size=2, max_cache_len=96, tokens_per_page=4) as cache:
        cache.generate(first, **kwargs)
        got = cache.generate(batch, **kwargs)
        assert torch.equal(got, want), name
        # row 0 alone would hit 28 tokens, row 1 12: both start at 12
        assert cache.last_call["cached_tokens"] == 2 * 12 == 2 * cache.last_call["common_cached_length"]
        cache.manager.check()
