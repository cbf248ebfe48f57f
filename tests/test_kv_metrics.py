"""The library's own timing: a KVMetricsCollector passed to the manager (and so to its backend)
counts operations, outermost calls only, and splits backend mapping into inline and background;
the engine's stats() and /metrics read it."""

from __future__ import annotations

import threading

import pytest

from vmemkv import ConfigError, KVCacheManager, KVMetricsCollector, UnknownRequestError
from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.llm_engine import LLMEngine, run_to_completion
from vmemkv.engine.core.sampling_params import SamplingParams

from conftest import assert_no_leaks, close_manager, tiny_config


@pytest.fixture
def timed():
    metrics = KVMetricsCollector()
    manager = KVCacheManager(tiny_config(), metrics=metrics)
    yield manager, metrics
    try:
        assert_no_leaks(manager)
    finally:
        close_manager(manager)


def test_without_a_collector_nothing_is_recorded(make_manager):
    manager = make_manager()
    assert manager.metrics is None and manager.backend.metrics is None
    manager.admit("a", list(range(1, 10)))
    manager.commit("a")


def test_operations_are_counted_once_each_outermost_only(timed):
    manager, metrics = timed
    assert manager.backend.metrics is metrics
    manager.admit("a", list(range(1, 10)))
    manager.commit("a")
    for token in range(3):
        assert manager.allocate("a", 1, [token + 1])
        manager.commit("a")
    manager.preempt("a", "recompute")  # calls free inside: counted as preempt only
    ops = metrics.snapshot()["operations"]
    assert {name: op["calls"] for name, op in ops.items()} == {
        "admit": 1, "commit": 4, "allocate": 3, "preempt": 1}
    assert all(op["seconds"] > 0 for op in ops.values())
    snapshot = metrics.snapshot()
    assert snapshot["manager_seconds"] == pytest.approx(sum(op["seconds"] for op in ops.values()))
    assert snapshot["manager_seconds"] == pytest.approx(metrics.manager_seconds)
    assert snapshot["manager_calls"] == 9
    assert not metrics.busy


def test_a_refused_operation_is_counted_and_raises_as_without_a_collector(timed):
    manager, metrics = timed
    with pytest.raises(UnknownRequestError):
        manager.allocate("nobody", 1)
    assert not metrics.busy  # the next operation is timed again
    assert metrics.operations["allocate"].calls == 1
    manager.admit("a", [1, 2, 3])
    assert metrics.operations["admit"].calls == 1


def test_mapping_is_split_into_inline_and_background(timed):
    manager, metrics = timed
    manager.admit("a", list(range(1, 5)))  # one full page of 4 tokens: admit maps it inline
    manager.commit("a")
    inline = metrics.inline_mapping.calls
    assert inline >= 1 and metrics.inline_mapping.seconds > 0
    jobs = manager.allocate_lookahead(["a"], 4)
    assert jobs
    worker = threading.Thread(target=manager.map_lookahead, args=(jobs,))
    worker.start()
    worker.join()
    assert metrics.background_mapping.calls >= 1 and metrics.background_mapping.seconds > 0
    assert metrics.inline_mapping.calls == inline
    assert "map_lookahead" not in metrics.operations  # the worker's job is not step-thread time
    assert manager.allocate("a", 1, [9])  # the page mapped in the background: no inline map
    assert metrics.inline_mapping.calls == inline


def test_a_collector_must_be_a_collector():
    with pytest.raises(ConfigError, match="KVMetricsCollector"):
        KVCacheManager(tiny_config(), metrics={})


def test_engine_stats_and_prometheus_read_the_collector():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=128))
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        run_to_completion(engine, [(str(i), list(range(1 + i, 15 + i)), params) for i in range(3)])
        stats = engine.stats()
        assert stats["manager_seconds"] > 0
        assert stats["manager_operations"]["admit"]["calls"] == 3
        assert stats["inline_map_seconds"] > 0  # admissions map their pages on the step thread
        assert stats["manager_seconds"] < stats["step_seconds"]
        text = engine.metrics.render().decode()
        assert 'vmemkv_kv_manager_calls_total{operation="admit"} 3.0' in text
        assert 'vmemkv_kv_mapping_seconds_total{where="inline"}' in text
        assert 'vmemkv_kv_mapping_seconds_total{where="background"}' in text
        # what one token holds per layer: K and V of every KV head
        per_layer = stats["kv_bytes_per_token_per_layer"]
        layout = engine.manager.groups[0].layout
        assert per_layer == 2 * layout.num_kv_heads * layout.head_dim * layout.itemsize
        assert f"vmemkv_kv_bytes_per_token_per_layer {float(per_layer)}" in text
    finally:
        engine.close()
