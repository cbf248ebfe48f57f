"""What each layer kind reads (``AttentionSpec``: full, sliding window, chunked local) and what the
manager may therefore release, against the attention rules written out here; and the manager
with chunked local attention (``CacheConfig.attention_chunk_size``, Llama-4's): exact blocks of
finished chunks given back, prefix hits that need no earlier chunk, refusals. The random walk
over every manager path with chunks is ``test_manager_state_machine.py``'s chunked machine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vmemkv import CacheConfig, ConfigError, KVCacheManager, KVRequest, RequestStateError
from vmemkv.cache.attention_spec import CHUNKED, FULL, SLIDING, AttentionSpec
from vmemkv.cache.request import RELEASED

from conftest import assert_no_leaks, close_manager, read_kv_matches, write_kv
from test_window_release import P as WINDOW_TEST_P, decode, run
from test_window_release import make_manager as window_manager

P = WINDOW_TEST_P  # tokens per block (4)
C = 8  # the chunk in the manager tests


def keys_read(kind: str, size: int | None, position: int) -> range:
    """The rule itself: the key positions a query at ``position`` attends to."""
    if kind == SLIDING:
        return range(max(0, position - size + 1), position + 1)
    if kind == CHUNKED:
        return range(position - position % size, position + 1)
    return range(0, position + 1)


specs = st.one_of(st.just(AttentionSpec()),
                  st.builds(AttentionSpec, st.sampled_from([SLIDING, CHUNKED]), st.integers(1, 40)))


@given(specs, st.integers(0, 300), st.integers(0, 100), st.integers(1, 16))
def test_what_is_released_is_never_read_again_and_what_is_kept_is_read(spec, position, later, tokens_per_block):
    first_block = spec.first_needed_block(position, tokens_per_block)
    for query in (position, position + later):  # the next query and any later one
        assert min(keys_read(spec.kind, spec.size, query)) >= first_block * tokens_per_block
    assert spec.first_read(position) == min(keys_read(spec.kind, spec.size, position))


@given(specs, st.integers(1, 200), st.integers(1, 50), st.integers(1, 16))
def test_peak_blocks_bounds_what_a_chunked_prefill_holds(spec, num_tokens, chunk_tokens, tokens_per_block):
    """Computing ``num_tokens`` in steps of ``chunk_tokens``, releasing after each step what the
    next query does not read: the blocks held never exceed ``peak_blocks``."""
    peak, done = 0, 0
    while done < num_tokens:
        end = min(done + chunk_tokens, num_tokens)
        released = spec.first_needed_block(done, tokens_per_block)  # released at the last commit
        peak = max(peak, -(-end // tokens_per_block) - released)
        done = end
    assert peak <= spec.peak_blocks(num_tokens, chunk_tokens, tokens_per_block)
    assert spec.peak_blocks(num_tokens, None, tokens_per_block) == -(-num_tokens // tokens_per_block)


@given(specs, st.lists(st.booleans(), max_size=20), st.integers(1, 8))
def test_a_prefix_hit_is_the_longest_whose_next_query_reads_only_cached_blocks(spec, cached, tokens_per_block):
    hits, first = spec.prefix_hits(len(cached), lambda i: cached[i], tokens_per_block)
    def usable(n):  # the query at n * P reads blocks first_needed .. n - 1: all cached
        return all(cached[spec.first_needed_block(n * tokens_per_block, tokens_per_block):n])
    best = max([n for n in range(1, len(cached) + 1) if usable(n)], default=0)
    assert hits == best
    assert first == (spec.first_needed_block(hits * tokens_per_block, tokens_per_block) if hits else 0)


def test_bad_specs_are_config_errors():
    for bad in (dict(kind="global"), dict(kind=SLIDING), dict(kind=FULL, size=4)):
        with pytest.raises(ConfigError):
            AttentionSpec(**bad)
    with pytest.raises(ConfigError, match="one of them"):
        AttentionSpec.of(sliding_window=4, chunk_size=8)


# --- the manager with chunked local attention -------------------------------------------------------

def make_manager(**overrides) -> KVCacheManager:
    """test_window_release's manager (blocks of P tokens) with chunks of C instead of a window."""
    return window_manager(**{"sliding_window": None, "attention_chunk_size": C, "hash_seed": b"chunked",
                             **overrides})


def test_the_blocks_of_finished_chunks_are_released_at_commit():
    m = make_manager()
    req = run(m, "a", list(range(1, 7)))  # 6 tokens, all in chunk 0..7: nothing to release
    assert req.block_table == (0, 1) and req.num_released_blocks == 0
    for token in range(24):
        decode(m, req, token)  # the next query, at num_tokens, reads from its chunk start
        assert req.num_released_blocks == (req.num_tokens // C * C) // P
        assert set(req.block_table[:req.num_released_blocks]) <= {RELEASED}
        m.check()
        assert m.num_blocks_in_use <= C // P + 1  # the chunk's blocks and the one it writes
        assert read_kv_matches(m, "a", start=req.num_released_blocks * P)
    assert m.cache_stats().blocks_released_behind_window == req.num_released_blocks == 6
    assert_no_leaks(m)
    close_manager(m)


def test_a_prefix_past_a_chunk_boundary_needs_no_block_of_earlier_chunks():
    """A query reads only its own chunk, so a prompt's positions before its last chunk start are
    never read by anything after them: admitted, they count as computed with no block (vLLM's
    chunked local manager marks them null blocks); the chunk the next query reads must be cached."""
    m = make_manager()
    prompt = list(range(1, 21))  # 20 tokens: the first query to compute is at 16, in chunk 16..23
    a = KVRequest("a", list(prompt))
    assert m.admit(a) == 16 and a.block_table[:4] == (RELEASED,) * 4
    write_kv(m, "a", 16, 20)
    m.commit(a)
    m.check()
    b = KVRequest("b", prompt[:14] + [99, 98])  # 16 tokens: its next query at 12 reads 8..12
    assert m.admit(b) == 8  # block 2 (positions 8-11) is not cached: the hit stops at chunk start 8
    m.check()
    m.free(a)
    m.free(b)
    assert_no_leaks(m)
    close_manager(m)


def test_a_truncation_into_a_released_chunk_is_refused_changing_nothing():
    m = make_manager()
    req = run(m, "a", list(range(1, 19)))  # 18 tokens: chunks 0-7 and 8-15 are never read again
    assert req.num_released_blocks == 4 and req.num_computed_tokens == 18
    with pytest.raises(RequestStateError, match="attention chunks of 8"):
        m.truncate(req, 12)  # a query at 12 reads 8..12
    assert req.num_tokens == 18 and req.num_released_blocks == 4
    assert m.truncate(req, 17)  # a query at 17 reads 16..17: still resident
    m.check()
    m.free(req)
    close_manager(m)


def test_blocks_for_tokens_counts_a_chunk_plus_a_prefill_chunk():
    m = make_manager()
    assert m.blocks_for_tokens(60) == 15  # all at once: every block
    assert m.blocks_for_tokens(60, chunk_tokens=1) == (C - 1 + 1 - 1 + P - 1) // P + 1
    close_manager(m)


def test_a_bad_chunk_size_or_both_kinds_is_a_config_error():
    for bad in (0, -8, 2.5):
        with pytest.raises(ConfigError, match="attention_chunk_size"):
            make_manager(attention_chunk_size=bad)
    with pytest.raises(ConfigError, match="one of them"):
        make_manager(sliding_window=6)


# --- a hybrid model's chunked local layers (Llama-4: chunked and global layers) ---------------------

def test_a_hybrid_chunked_group_gives_back_finished_chunks_and_hits_need_only_the_next_chunk():
    from vmemkv.cache.attention_spec import AttentionSpec as Spec
    from test_hybrid_groups import P as GROUP_P, close, decode, free_all, reads_back, run

    chunk = 40  # chunk boundaries inside 16-token blocks
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=40,
                         max_num_seqs=3, max_model_len=256, swap_space_bytes=64 << 10, hash_seed=b"hybrid")
    hybrid = KVCacheManager(config, layer_windows=[Spec(CHUNKED, chunk)] * 3 + [None], chunk_tokens=32)
    global_group, local_group = hybrid.layout_groups
    assert local_group.spec == Spec(CHUNKED, chunk) and not global_group.spec.releases
    prompt = list(range(1, 50))
    a = run(hybrid, "a", prompt)  # the query at 49 reads 40..49: local blocks 0-1 (0-31) go
    assert a.group_released_blocks(1) == 2 and a.num_released_blocks == 0
    for token in range(60):
        assert decode(hybrid, a, token)
        assert a.group_released_blocks(1) == (a.num_tokens // chunk * chunk) // GROUP_P
        hybrid.check()
        assert reads_back(hybrid, a)
    b = run(hybrid, "b", prompt)  # global blocks 0-2 cached; local: the query at 48 reads block 2
    assert b.num_computed_tokens == len(prompt) and hybrid.cache_stats().prefix_hit_tokens == 48
    hybrid.check()
    free_all(hybrid, [a, b])
    close(hybrid)
