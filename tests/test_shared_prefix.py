"""Shared-prefix decoding in the engine: which decoding sequences form groups (the same leading
physical blocks), and the engine's tokens with groups equal to HF ``generate`` and to the engine
without them, on both KV backends, after a cached prompt and for the forks of n > 1."""

from __future__ import annotations

import pytest

import vmemkv.attention.packed as packed
from test_engine_correctness import assert_clean, assert_matches_hf, greedy, make_engine, prompts, run
from vmemkv.attention.cpu_decode import unavailable
from vmemkv.attention.shared_prefix import MIN_SHARED_TOKENS, common_blocks, shared_prefixes
from vmemkv.engine import SamplingParams


def test_common_blocks():
    assert common_blocks((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_blocks((1, 2, 3), (1, 5, 3)) == 1
    assert common_blocks((), (1,)) == 0


def test_groups_of_equal_leading_blocks():
    tables = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9), (7, 8, 9, 10, 11), (1, 2, 3, 4, 5, 6, 13),
              (7, 8, 9, 10, 12), (-1, 14, 15, 16, 17), (20, 21, 22, 23, 24)]
    lengths = [90, 70, 80, 100, 75, 80, 80]
    leaders, shared = shared_prefixes(tables, lengths, 16)
    # 0, 1 and 3 share blocks 1-4 (64 tokens); 2 and 4 share 7-10; 5 (a window released its first
    # block) and 6 read alone
    assert leaders == [0, 0, 2, 0, 2, 5, 6]
    assert shared == [64, 64, 64, 64, 64, 0, 0]


def test_a_group_is_capped_by_its_shortest_member_and_short_prefixes_read_alone():
    tables = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7)]
    assert shared_prefixes(tables, [70, 100], 16) == ([0, 0], [70, 70])  # blocks hold 96 of them
    assert shared_prefixes(tables, [MIN_SHARED_TOKENS - 1, 100], 16) is None
    assert shared_prefixes([(1, 2, 3), (1, 2, 9), (1, 2, 3, 4, 5)], [40, 40, 70], 16) is None  # 48 < 64
    assert shared_prefixes([(1,), (2,)], [10, 10], 16) is None


needs_native = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")


@pytest.fixture
def groups_found(monkeypatch):
    """Every group the steps found, as the (leaders, lengths) pairs ``shared_prefixes`` returned."""
    found = []

    def spy(*args):
        result = shared_prefixes(*args)
        if result:
            found.append(result)
        return result

    monkeypatch.setattr(packed, "shared_prefixes", spy)
    return found


@needs_native
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_requests_after_a_cached_prompt_match_hf(kv_backend, groups_found):
    engine = make_engine(kv_backend=kv_backend, attention="native")
    system = prompts(1, lengths=(100,), offset=5)[0]  # six full 16-token pages
    batch = [system + tail for tail in prompts(4, lengths=(3, 11, 20, 7))]
    first = run(engine, batch[:1])
    rest = run(engine, batch[1:])
    assert all(output.num_cached_tokens == 96 for output in rest)
    assert any(lengths[0] >= 96 and len(set(leaders)) == 1 for leaders, lengths in groups_found)
    assert_matches_hf("tiny-llama", batch, first + rest)
    assert_clean(engine)


@needs_native
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_forks_of_parallel_sampling_give_the_same_tokens_with_and_without_groups(kv_backend, groups_found):
    prompt = prompts(1, lengths=(90,), offset=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0.9, n=3, seed=4, ignore_eos=True)
    tokens = {}
    for share in (True, False):
        engine = make_engine(kv_backend=kv_backend, attention="native", shared_prefix_decode=share)
        output = run(engine, [prompt], params)[0]
        tokens[share] = [completion.token_ids for completion in output.outputs]
        assert_clean(engine)
    assert groups_found, "the forks (which share the prompt's blocks) formed no group"
    assert tokens[True] == tokens[False]
    greedy_engine = make_engine(kv_backend=kv_backend, attention="native")
    assert_matches_hf("tiny-llama", [prompt], run(greedy_engine, [prompt], greedy(n=3)))
