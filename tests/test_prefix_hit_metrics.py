"""Honest prefix-cache figures: hits by tier, re-prefill after preemption apart from first
admissions, and the partial-page tokens (shared with a cached page past the page hits, but not
served because the shared part is shorter than a page), in ``cache_stats()`` and ``/metrics``."""

from __future__ import annotations

import torch
from prometheus_client.parser import text_string_to_metric_families

from vmemkv import CacheConfig, CacheKeys, KVCacheManager
from vmemkv.engine.core.metrics import EngineMetrics


def make_manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=128,
                                      dtype=torch.float32, tokens_per_page=4,
                                      num_blocks=num_blocks, max_num_seqs=4, max_model_len=32))


def admit(m: KVCacheManager, request_id: str, tokens: list[int], salt: str | None = None) -> int:
    cached = m.admit(request_id, tokens, keys=CacheKeys(cache_salt=salt))
    m.commit(request_id)
    return cached


def partial_after(m: KVCacheManager, request_id: str, tokens: list[int], salt=None) -> int:
    before = m.cache_stats().prefix_partial_page_tokens
    admit(m, request_id, tokens, salt)
    m.free(request_id)  # its full pages stay cached
    return m.cache_stats().prefix_partial_page_tokens - before


def test_partial_page_tokens_are_the_prefix_shared_with_a_cached_page_past_the_hits():
    m = make_manager()
    admit(m, "a", list(range(1, 11)))  # caches [1 2 3 4] and [5 6 7 8]
    assert m.cache_stats().prefix_partial_page_tokens == 0
    # page 0 hits; page 1 shares 5, 6 with the cached [5 6 7 8]
    assert partial_after(m, "b", [1, 2, 3, 4, 5, 6, 9, 9, 9]) == 2
    # a first page shares 1, 2 with the cached first page
    assert partial_after(m, "c", [1, 2, 9, 9, 9]) == 2
    # the prompt's last token is always computed: 7 tokens hit one page, and 5, 6 of page 1
    assert partial_after(m, "d", [1, 2, 3, 4, 5, 6, 7]) == 2
    # another tenant's pages are never counted, nor pages after another prefix
    assert partial_after(m, "e", [1, 2, 3, 4, 5, 6, 9, 9, 9], salt="other") == 0
    assert partial_after(m, "f", [0, 2, 3, 4, 5, 6, 7, 9, 9]) == 0
    stats = m.cache_stats()
    assert stats.prefix_hit_tokens == stats.prefix_hit_tokens_device == 4 + 0 + 4 + 0 + 0
    m.check()


def test_partial_page_index_forgets_evicted_pages():
    m = make_manager(num_blocks=3)
    admit(m, "a", [1, 2, 3, 4, 5])  # caches [1 2 3 4]
    m.free("a")
    admit(m, "b", [9, 9, 9, 9, 9, 9, 9, 9, 9])  # takes all three blocks: [1 2 3 4] is evicted
    m.free("b")
    assert partial_after(m, "c", [1, 2, 7]) == 0
    m.check()


def test_reprefill_after_preemption_is_counted_apart_in_stats_and_metrics():
    m = make_manager()
    metrics = EngineMetrics(cache_stats=m.cache_stats)
    prompt = list(range(1, 11))
    admit(m, "a", prompt)
    admit(m, "b", prompt)  # 8 tokens hit
    m.preempt("b", "recompute")
    assert m.admit("b", prompt) == 8  # re-admitted: its pages are still cached
    stats = m.cache_stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (20, 8)
    assert (stats.reprefill_queried_tokens, stats.reprefill_hit_tokens) == (10, 8)
    assert stats.prefix_hit_rate == 8 / 20
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}
    assert samples[("vmemkv_prefix_cache_hit_tokens_total", (("tier", "device"),))] == 8
    assert samples[("vmemkv_prefix_cache_queried_tokens_total", ())] == 20
    assert samples[("vmemkv_prefix_cache_reprefill_queried_tokens_total", ())] == 10
    assert samples[("vmemkv_prefix_cache_reprefill_hit_tokens_total", ())] == 8
    assert samples[("vmemkv_prefix_cache_partial_page_tokens_total", ())] == 0
    m.free("a")
    m.free("b")
    m.close()
    assert "vmemkv_prefix_cache_hit_tokens_total" not in metrics.render().decode()  # closed: none
