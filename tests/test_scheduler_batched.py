"""The scheduler's batched growth (``allocate_each``: one manager call for every running
sequence) schedules and preempts exactly as one ``allocate`` per sequence would: a manager whose
``allocate_each`` is one ``allocate`` per request gives the same trace, step for step."""

from __future__ import annotations

import random

import pytest

from conftest import assert_no_leaks, close_manager, tiny_config
from vmemkv import KVCacheManager, KVRequest
from vmemkv.engine import EngineConfig, SamplingParams
from vmemkv.engine.core.scheduler import Scheduler
from vmemkv.engine.core.sequence import Sequence


class PerCallManager:
    """A manager whose ``allocate_each`` grants its requests one ``allocate`` at a time, up to the
    first refused (the batched call's contract, in the simplest way)."""

    def __init__(self, manager: KVCacheManager):
        self._manager = manager

    def allocate_each(self, requests, counts) -> int:
        for granted, (request, count) in enumerate(zip(requests, counts)):
            if not self._manager.allocate(request, count):
                return granted
        return len(requests)

    def __getattr__(self, name):
        return getattr(self._manager, name)


def drive(scheduler: Scheduler, prompts: list[list[int]], seed: int) -> list:
    """Run ``prompts`` (max_tokens=1 each, grown by random tokens to 30) to the end, one token a
    step; returns each step's (scheduled ids and counts, preemptions, failures)."""
    rng = random.Random(seed)
    for index, prompt in enumerate(prompts):
        seq = Sequence(KVRequest(str(index), list(prompt)), str(index), None, SamplingParams(max_tokens=1),
                       len(prompt))
        scheduler.add(seq)
    trace = []
    for _ in range(200):
        if not (scheduler.running or scheduler.waiting or scheduler.swapped):
            break
        out = scheduler.schedule()
        trace.append(([(item.seq.request_id, item.num_new_tokens) for item in out.scheduled],
                      scheduler.num_preemptions, [seq.request_id for seq, _ in out.failed]))
        for item in out.scheduled:
            scheduler.manager.commit(item.seq.kv)
            kv = item.seq.kv
            if kv.num_computed_tokens == len(kv.token_ids):
                if len(kv.token_ids) >= 30:
                    scheduler.remove(item.seq)
                else:
                    kv.token_ids.append(rng.randrange(1, 200))
    assert not (scheduler.running or scheduler.waiting or scheduler.swapped)
    return trace


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_batched_growth_schedules_and_preempts_as_one_call_per_sequence(mode):
    prompts = [[100 + i] + [(i * 7 + j) % 90 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    traces = []
    for wrap in (lambda m: m, PerCallManager):
        manager = KVCacheManager(tiny_config(num_blocks=16, max_num_seqs=6, max_model_len=40))
        try:
            config = EngineConfig(max_num_seqs=6, max_model_len=40, max_num_batched_tokens=24,
                                  watermark=0.0, preemption_mode=mode)
            traces.append(drive(Scheduler(config, wrap(manager)), prompts, seed=1))
            assert_no_leaks(manager)
        finally:
            close_manager(manager)
    batched, per_call = traces
    assert batched == per_call
    assert batched[-1][1] > 0  # the pool is short: sequences were preempted
