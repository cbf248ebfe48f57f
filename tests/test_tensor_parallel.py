"""Tensor parallelism on CPU with gloo, two ranks: the same greedy tokens as one rank and as
Hugging Face ``generate`` under prefix hits, forks (n > 1) and preemption by swap and by recompute,
with every rank's page-mapping state compared every step; a diverged rank and a killed worker
stop the engine with a clear error. The recorder and its replay are checked without processes.

The tests that start worker processes (``spawns``: two engines, about 4 s of start-up each) run in
the default suite; ``-m "not spawns"`` leaves them out."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from test_engine_correctness import hf_greedy, make_engine, prompts, run
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.distributed import TensorParallelError
from vmemkv.engine.distributed.recorder import BackendRecorder, replay, state_digest
from vmemkv.engine.distributed.sharding import check_shardable
from vmemkv.engine.models import load_model, model_config
from vmemkv.errors import ConfigError, UnsupportedModelError
from vmemkv.swap import SwapSpace
from vmemkv.vmm import create_backend

TP = dict(tensor_parallel_size=2, tensor_parallel_check=True, tensor_parallel_timeout=30)


def assert_hf(batch, outputs, new_tokens: int = 12) -> None:
    for prompt, output in zip(batch, outputs):
        for completion in output.outputs:
            assert completion.token_ids == hf_greedy("tiny-llama", tuple(prompt), new_tokens)


def assert_every_forward_checked(engine) -> None:
    leader = engine.tensor_parallel
    assert leader.failure is None and leader.num_steps > 0
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0


@pytest.fixture(scope="class")
def swap_engine():
    # 12 blocks of 16 tokens: the preemption workload must swap someone out.
    engine = make_engine(num_blocks=12, preemption_mode="swap", watermark=0.0, **TP)
    yield engine
    engine.close()


@pytest.mark.spawns
class TestOneEngineWithSwap:
    """One engine for these (a process holds one tensor-parallel engine at a time)."""

    def test_ragged_batch_matches_one_rank_and_hf(self, swap_engine):
        batch = prompts(4)
        outputs = run(swap_engine, batch)
        one_rank = run(make_engine(), batch)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in one_rank]
        assert_hf(batch, outputs)
        assert_every_forward_checked(swap_engine)


    def test_prefix_hits_and_forks_match_hf(self, swap_engine):
        system = prompts(1, lengths=(40,), offset=5)[0]
        batch = [system + tail for tail in prompts(3, lengths=(3, 11, 7))]
        first = run(swap_engine, batch[:1])
        rest = run(swap_engine, batch[1:])
        assert all(output.num_cached_tokens == 32 for output in rest)  # two full pages hit
        forks_before = swap_engine.manager.cache_stats().forks
        forked = run(swap_engine, [prompts(1, lengths=(21,))[0]],
                     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3))
        assert swap_engine.manager.cache_stats().forks == forks_before + 2
        assert_hf(batch + [prompts(1, lengths=(21,))[0]], first + rest + forked)
        assert_every_forward_checked(swap_engine)


    def test_swap_preemption_matches_hf(self, swap_engine):
        batch = prompts(6, lengths=(30, 35, 40, 28, 33, 38))
        swapped = swap_engine.manager.cache_stats().preemptions_swap
        outputs = run(swap_engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert swap_engine.manager.cache_stats().preemptions_swap > swapped
        assert_hf(batch, outputs, 20)
        assert_every_forward_checked(swap_engine)

    def test_killed_worker_stops_the_engine_with_a_clear_error(self, swap_engine):
        """Last in the class: it ends this engine."""
        engine = swap_engine
        engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        worker = engine.tensor_parallel.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
            for _ in range(50):
                engine.step()
        with pytest.raises(TensorParallelError):  # and it stays stopped
            engine.step()


@pytest.mark.spawns
def test_recompute_preemption_matches_hf_and_a_diverged_rank_stops_the_engine():
    engine = make_engine(num_blocks=12, preemption_mode="recompute", enable_prefix_caching=False,
                         watermark=0.0, **TP)
    try:
        batch = prompts(6, lengths=(30, 35, 40, 28, 33, 38))
        outputs = run(engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert engine.manager.cache_stats().preemptions_recompute > 0
        assert_hf(batch, outputs, 20)
        assert_every_forward_checked(engine)
        # A mapping made on rank 0 behind the recorder's back, on the last slot's last page (which
        # the next step does not touch): the next step's check must see it.
        recorder = engine.tensor_parallel.recorder
        table = recorder.ranges[0].page_table
        recorder.inner.map(recorder.ranges[0], [len(table) - 1], [(int(table[-1]) + 1) % 12])
        engine.add_request("late", prompts(1)[0], SamplingParams(max_tokens=2))
        with pytest.raises(TensorParallelError, match="mapping state differs"):
            engine.step()
        with pytest.raises(TensorParallelError):  # and it stays stopped
            engine.step()
        assert not any(p.is_alive() for p in engine.tensor_parallel.processes)
    finally:
        engine.close()


# --- without processes ---------------------------------------------------------------------------

def test_replayed_log_gives_the_same_mappings_bytes_and_swap_state():
    page = 4096
    source, target = (BackendRecorder(create_backend("cpu", page, 8)) for _ in range(2))
    swaps = [SwapSpace(4, page), SwapSpace(4, page)]
    try:
        ranges = [recorder.reserve(6) for recorder in (source, target)]
        for recorder in (source, target):  # each rank makes its reservations itself
            recorder.take_log()
        window = source.pool_window()
        window[3].fill_(7)
        source.map(ranges[0], [0, 1, 4], [3, 5, 6])
        source.copy_pages([3], [2])
        source.unmap(ranges[0], [1])
        host = swaps[0].store(window, [2, 3])
        source.record_swap(("swap_out", [2, 3], host))
        target.pool_window()[3].fill_(7)  # the forward's writes, done by each rank itself
        log, digest = source.take_log(digest=True)
        assert [entry[0] for entry in log] == ["map", "copy", "unmap", "swap_out"]
        replay(log, target, swaps[1], target.pool_window())
        assert np.array_equal(ranges[0].page_table, ranges[1].page_table)
        assert torch.equal(swaps[0].storage[host], swaps[1].storage[host])  # the rows stored
        assert torch.equal(target.pool_window()[2], torch.full((page,), 7, dtype=torch.uint8))
        source.swap_space = swaps[0]
        assert state_digest(source, swaps[0]) == state_digest(target, swaps[1])
        swaps[1].discard([0])
        assert state_digest(source, swaps[0]) != state_digest(target, swaps[1])
        assert digest is not None
    finally:
        source.close()
        target.close()


def test_models_that_cannot_be_split_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="at least 2 KV heads"):
        check_shardable(model_config("tiny-qwen2"), 2)  # one KV head: not replicated
    with pytest.raises(ConfigError, match="must divide"):
        check_shardable(model_config("smollm2-135m"), 2)  # 9 heads, 3 KV heads
    config = model_config("tiny-llama")
    config.base_model_tp_plan = None
    with pytest.raises(UnsupportedModelError, match="no tensor-parallel plan"):
        check_shardable(config, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        make_engine(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="at least 2 KV heads"):  # refused before any process
        make_engine("tiny-qwen2", tensor_parallel_size=2)
    model, tokenizer = load_model("tiny-llama")
    with pytest.raises(ConfigError, match="by name"):  # the other ranks could not load it
        LLMEngine(EngineConfig(tensor_parallel_size=2), model, tokenizer)
    assert not torch.distributed.is_initialized()
