"""Tensor parallelism on CPU with gloo, two ranks: the same greedy tokens as one rank and as
Hugging Face ``generate`` under prefix hits, forks (n > 1) and preemption by swap and by recompute,
with every rank's page-mapping state compared every step; a windowed model (tiny-mistral) and a
hybrid one (tiny Gemma-2: local and global layers in two layout groups on every rank) with blocks
released behind the window; int8 KV; a diverged rank and a killed worker stop the engine with a clear
error. Workers read the slot runs rank 0 read in one call, in one call too. The recorder and its replay (two groups in one log) are checked without processes.

The tests that start worker processes (``spawns``: the engines each started once for its class;
workers fork from a fork server that imported the engine once, so a start takes well under a
second after the session's first) run in the default suite; ``-m "not spawns"`` leaves them out."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from test_engine_correctness import hf_greedy, make_engine, prompts, run
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.distributed import TensorParallelError
from vmemkv.engine.distributed.recorder import BackendRecorder, Recording, replay, state_digest
from vmemkv.engine.distributed.sharding import check_shardable
from vmemkv.engine.models.zoo import byte_tokenizer, load_model, model_config
from vmemkv.errors import ConfigError, UnsupportedModelError
from vmemkv.cache.attention_spec import SLIDING, AttentionSpec
from vmemkv.cache.swap import SwapSpace
from vmemkv.memory.vmm import create_backend

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
    # 12 blocks of 16 tokens: the preemption workload must swap someone out. SDPA: its decodes
    # read runs of slots, whose filler pages the worker must map as the leader does.
    engine = make_engine(num_blocks=12, preemption_mode="swap", watermark=0.0, attention="sdpa", **TP)
    yield engine
    engine.close()


@pytest.mark.spawns
class TestOneEngine:
    """One engine, started once, for these (a process holds one tensor-parallel engine at a time,
    and starting one, its worker and their process group is most of a test's time)."""

    def test_ragged_batch_matches_one_rank_and_hf(self, swap_engine):
        batch = prompts(4)
        outputs = run(swap_engine, batch)
        one_rank = run(make_engine(), batch)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in one_rank]
        assert_hf(batch, outputs)
        assert_every_forward_checked(swap_engine)
        # the decodes were read in one call per slot run on rank 0, and on the worker with it
        # (its page tables checked equal every step: it mapped no filler of its own)
        assert swap_engine.tensor_parallel.batched_read_runs > 0

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

    def test_recompute_preemption_matches_hf(self, swap_engine, monkeypatch):
        # The scheduler reads the mode at each preemption: this engine recomputes for this test.
        monkeypatch.setattr(swap_engine.scheduler.config, "preemption_mode", "recompute")
        swap_engine.manager.reset_prefix_cache()  # the preempted requests recompute every token
        batch = prompts(6, lengths=(30, 35, 40, 28, 33, 38), offset=40)
        recomputed = swap_engine.manager.cache_stats().preemptions_recompute
        outputs = run(swap_engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert swap_engine.manager.cache_stats().preemptions_recompute > recomputed
        assert_hf(batch, outputs, 20)
        assert_every_forward_checked(swap_engine)

    def test_a_diverged_rank_stops_the_engine(self, swap_engine):
        """Last in the class: it ends this engine."""
        engine = swap_engine
        # A mapping made on rank 0 behind the recorder's back, on the last slot's last page (which
        # the next step does not touch): the next step's check must see it.
        recorder = engine.tensor_parallel.recording.recorders[0]
        table = recorder.ranges[0].page_table
        recorder.inner.map(recorder.ranges[0], [len(table) - 1], [(int(table[-1]) + 1) % 12])
        engine.add_request("late", prompts(1)[0], SamplingParams(max_tokens=2))
        with pytest.raises(TensorParallelError, match="mapping state differs"):
            engine.step()
        with pytest.raises(TensorParallelError):  # and it stays stopped
            engine.step()
        assert not any(p.is_alive() for p in engine.tensor_parallel.processes)


# --- a hybrid model: local and global layers in two layout groups on every rank -----------------

@pytest.fixture(scope="class")
def gemma2_dir(tmp_path_factory):
    """A tiny Gemma-2 (one local layer with a window of 3, one global) saved where every rank
    loads it by name (2 KV heads: one a rank)."""
    from test_sliding_window_models import build

    model = build("gemma2", head_dim=64, query_pre_attn_scalar=64)
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory), model


@pytest.fixture(scope="class")
def gemma2_engine(gemma2_dir):
    engine = make_engine(gemma2_dir[0], max_num_seqs=3, max_model_len=96,
                         max_num_batched_tokens=16, **TP)
    yield engine
    engine.close()


def assert_local_and_global_groups(manager) -> None:
    """The tiny Gemma-2's global layer in layer group 0, its local layer (window 3) in group 1."""
    groups = manager.layout_groups
    assert len(groups) == 2
    assert groups[0].layers == (1,) and not groups[0].spec.releases
    assert groups[1].layers == (0,) and groups[1].spec == AttentionSpec(SLIDING, 3)


@pytest.mark.spawns
class TestHybridEngine:
    def test_two_ranks_match_one_and_hf_with_local_blocks_released(self, gemma2_dir, gemma2_engine):
        directory, model = gemma2_dir
        engine = gemma2_engine
        assert_local_and_global_groups(engine.manager)
        assert engine.manager.tokens_per_page == 16  # 50 tokens: local blocks 0-1 go behind the window
        batch = prompts(3, lengths=(20, 9, 31))
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        outputs = run(engine, batch, params)
        one = make_engine(directory, max_num_seqs=3, max_model_len=96, max_num_batched_tokens=16)
        assert_local_and_global_groups(one.manager)
        one_rank = run(one, batch, params)
        one.close()
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert tokens == [o.outputs[0].token_ids for o in one_rank]
        for prompt, got in zip(batch, tokens):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
            assert got == out[0, len(prompt):].tolist()
        # the local group gave blocks back on rank 0, and every rank replayed it (digests checked)
        assert engine.manager.cache_stats().blocks_released_behind_window > 0
        # one local and one global layer: both groups draw from one pool, so rank 0 records one
        # backend holding both groups' reservations
        assert len(engine.manager.memories) == 1
        assert [len(r.ranges) for r in engine.tensor_parallel.recording.recorders] == [2]
        assert_every_forward_checked(engine)
        assert engine.manager.layout_groups[1].num_blocks_in_use == 0

    def test_killed_worker_stops_the_engine_with_a_clear_error(self, gemma2_engine):
        """Last in the class: it ends this engine."""
        engine = gemma2_engine
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
def test_quantized_kv_on_two_ranks_matches_one_rank():
    """int8 KV (``kv_cache_dtype``): a rank quantizes its own heads' rows, one scale per token,
    head and 32 values, the scales one rank would compute, so two ranks give one rank's tokens,
    under prefix hits and forks; the scales live in the rows every rank maps (the page-mapping
    state compared every step)."""
    system = prompts(1, lengths=(140,), offset=5)[0]  # two full pages of 64 int8 rows
    batch = [system + tail for tail in prompts(3, lengths=(3, 11, 7))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2)
    tokens = []
    for options in (TP, {}):
        engine = make_engine(kv_cache_dtype="int8", **options)
        try:
            outputs = run(engine, batch[:1], params) + run(engine, batch[1:], params)
            pages = 140 // engine.manager.tokens_per_page  # the system prompt's full pages hit
            assert pages and all(output.num_cached_tokens == pages * engine.manager.tokens_per_page
                                 for output in outputs[1:])
            if options:
                assert_every_forward_checked(engine)
            tokens.append([[c.token_ids for c in o.outputs] for o in outputs])
        finally:
            engine.close()
    assert tokens[0] == tokens[1]


@pytest.mark.spawns
def test_a_windowed_model_releases_blocks_on_every_rank_and_matches_hf():
    """tiny-mistral (every layer slides, window 128): one windowed group, blocks behind the
    window released on rank 0 and replayed; batched reads on rank 0 only (the worker reads each
    sequence from its window start), the digests agree every step."""
    engine = make_engine("tiny-mistral", max_num_seqs=3, max_model_len=256, **TP)
    try:
        batch = prompts(2, lengths=(150, 160))
        outputs = run(engine, batch, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert engine.manager.cache_stats().blocks_released_behind_window > 0
        for prompt, output in zip(batch, outputs):
            assert output.outputs[0].token_ids == hf_greedy("tiny-mistral", tuple(prompt), 8)
        assert_every_forward_checked(engine)
    finally:
        engine.close()


def rss_shmem_bytes(pid: int) -> int:
    """The shared memory a process has resident (its memfd pages mapped): RssShmem, /proc."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


@pytest.mark.spawns
def test_a_shared_budget_pays_for_every_rank_and_an_idle_give_back_reaches_every_rank(tmp_path, monkeypatch):
    """Rank 0 is the budget's one member and its share pays for both ranks' blocks; the idle
    give-back is sent to the worker at once (no forward), whose resident KV memory falls; the
    tokens after it, on blocks taken again on every rank, still equal HF's."""
    monkeypatch.setenv("VMEMKV_KV_POOL_DIR", str(tmp_path))
    engine = make_engine(kv_pool="tp", kv_pool_bytes=64 << 20, kv_idle_release_s=0, **TP)
    try:
        worker = engine.tensor_parallel.processes[0].pid
        batch = prompts(3)
        assert_hf(batch, run(engine, batch, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        stats = engine.stats()
        assert stats["kv_pool_share_bytes"] >= 2 * stats["kv_bytes_resident"] > 0  # both ranks' blocks
        before, steps = rss_shmem_bytes(worker), engine.tensor_parallel.num_steps
        assert engine.on_idle() > 0
        assert engine.stats()["kv_pool_share_bytes"] == 0
        assert engine.tensor_parallel.num_steps == steps  # no forward was sent
        for _ in range(100):  # the worker replays the give-back as it receives it
            if rss_shmem_bytes(worker) < before - stats["kv_bytes_resident"] // 2:
                break
            time.sleep(0.05)
        assert rss_shmem_bytes(worker) < before - stats["kv_bytes_resident"] // 2
        assert_hf(batch, run(engine, batch, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        assert_every_forward_checked(engine)
    finally:
        engine.close()


# --- without processes ---------------------------------------------------------------------------

def test_replayed_log_gives_the_same_mappings_bytes_and_swap_state():
    """Two pools per rank (a hybrid model's layer groups of different bytes): one log, each entry
    naming its pool, replayed onto the other rank's pools gives the same page tables, copied
    bytes and swap state, and the digest covers both pools."""
    page = 4096
    source, target = Recording(), Recording()
    for recording in (source, target):
        for _ in range(2):  # the global group's pool's backend and swap space, then the local group's
            recorder = BackendRecorder(create_backend("cpu", page, 8), recording)
            recorder.swap_space = SwapSpace(4, page)
    try:
        ranges = [[recorder.reserve(6) for recorder in recording.recorders] for recording in (source, target)]
        for recording in (source, target):  # each rank makes its reservations itself
            recording.take_log()
        first, second = source.recorders
        for recording in (source, target):  # the forward's writes, done by each rank itself
            recording.recorders[1].pool_window()[3].fill_(7)
        first.map(ranges[0][0], [0, 1, 4], [3, 5, 6])
        second.map(ranges[0][1], [2], [3])
        second.copy_pages([3], [2])
        first.unmap(ranges[0][0], [1])
        host = second.swap_space.store(second.pool_window(), [2, 3])
        second.record_swap("swap_out", [2, 3], host)
        log, digest = source.take_log(digest=True)
        assert [entry[:2] for entry in log] == [(0, "map"), (1, "map"), (1, "copy"), (0, "unmap"),
                                                (1, "swap_out")]
        replay(log, target, [recorder.pool_window() for recorder in target.recorders])
        for group in (0, 1):
            assert np.array_equal(ranges[0][group].page_table, ranges[1][group].page_table)
        swaps = [recording.recorders[1].swap_space for recording in (source, target)]
        assert torch.equal(swaps[0].storage[host], swaps[1].storage[host])  # the rows stored
        assert torch.equal(target.recorders[1].pool_window()[2], torch.full((page,), 7, dtype=torch.uint8))
        assert state_digest(source) == state_digest(target) == digest
        target.recorders[1].inner.map(ranges[1][1], [5], [7])  # the local group diverges
        assert state_digest(source) != state_digest(target)
        swaps[1].discard([0])
        target.recorders[1].inner.unmap(ranges[1][1], [5])
        assert state_digest(source) != state_digest(target)  # its swap space too
    finally:
        for recording in (source, target):
            for recorder in recording.recorders:
                recorder.close()


def test_pages_given_back_and_taken_again_are_replayed():
    """A give-back is logged (only when it gave something) and replayed: the other rank's pages
    go back too (its memfd's count falls, the page reads zeros); a take is logged for backends
    that take pages back explicitly (CUDA) and replayed as one."""
    page = 4096
    source, target = Recording(), Recording()
    for recording in (source, target):
        BackendRecorder(create_backend("cpu", page, 8), recording)
    try:
        for recording in (source, target):
            recording.recorders[0].pool_window()[2:4].fill_(5)
        (first,), (other,) = source.recorders, target.recorders
        resident = other.resident_bytes()
        assert first.discard_pages([2, 3]) == 2 and first.discard_pages([7]) == 1
        first.take_pages([2])
        log, _ = source.take_log()
        assert [entry[:2] for entry in log] == [(0, "discard"), (0, "discard"), (0, "take")]
        replay(log, target, [other.pool_window()])
        assert other.resident_bytes() == resident - 2 * page
        assert not other.pool_window()[2:4].any()
    finally:
        for recording in (source, target):
            recording.recorders[0].close()


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
