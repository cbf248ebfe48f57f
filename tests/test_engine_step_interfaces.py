"""The engine's seams, as behaviour: the manager it is built with satisfies the protocol it calls
(``kv_manager.KVManager``; a tensor-parallel worker's view of one, ``KVViews``); one factory
shapes the manager for a model (one layer group, or one per kind of layer); the scheduler plans
every KV change of a step (the forks of ``n > 1`` under its slots and watermark, lookahead
blocks) and its ``update`` is where the queues follow what the step did."""

from __future__ import annotations

import pytest

from conftest import assert_no_leaks, close_manager, tiny_config
from vmemkv import KVCacheManager, KVRequest
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.kv_manager import KVManager, KVViews, layer_windows, make_kv_manager
from vmemkv.engine.core.scheduler import Scheduler, StepResult
from vmemkv.engine.core.sequence import Sequence
from vmemkv.engine.distributed.worker import _ReplayedReads

from test_sliding_window_models import build


def test_the_engines_manager_satisfies_the_protocol_and_a_workers_view_its_views():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64))
    assert isinstance(engine.manager, KVManager)
    view = _ReplayedReads(engine.manager)
    assert isinstance(view, KVViews)
    assert view.layout_groups == engine.manager.layout_groups
    engine.close()


def test_the_scheduler_is_the_one_part_holding_the_manager():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64, lookahead_tokens=4))
    manager = engine.manager
    assert manager is engine.scheduler.manager
    parts = {"engine": engine, "runner": engine.runner, "lookahead": engine.runner.lookahead,
             "addressing": engine.addressing, "postprocessor": engine.postprocessor,
             "elastic": engine.elastic, "metrics": engine.metrics,
             "policy": engine.scheduler.policy, "lpm ranking": engine.scheduler.policy.ranking}
    holders = [name for name, part in parts.items()
               if any(value is manager or getattr(value, "__self__", None) is manager
                      for value in vars(part).values())]
    assert holders == []
    with pytest.raises(AttributeError):
        engine.manager = manager  # read-only: the scheduler's
    plan = engine.scheduler.schedule()  # the plan carries what the runner and postprocessor do
    assert plan.kv is engine.scheduler.kv_step and not hasattr(plan.kv, "admit")
    engine.close()


def test_the_factory_gives_a_hybrid_model_one_group_per_kind_of_layer_unless_told_not_to():
    model = build("gemma2")
    config = EngineConfig(model="tiny-gemma2", max_num_seqs=2, max_model_len=96, tokens_per_page=4)
    assert layer_windows(model.config, 96) == [3, None]
    assert layer_windows(model.config, 96, release_behind_window=False) is None
    for release, groups in ((True, 2), (False, 1)):
        manager = make_kv_manager(config.cache_config(model), model.config, max_model_len=96,
                                  chunk_tokens=8, release_behind_window=release)
        assert len(manager.layout_groups) == groups
        assert isinstance(manager, KVManager)
        manager.close()


# --- the scheduler plans the step's KV changes; update is where its queues follow the step ----------
def new_fork(first: Sequence, index: int) -> Sequence:
    return Sequence(KVRequest(f"{first.request_id}#{index}", first.prompt_token_ids), first.request_id, None,
                    first.params, first.num_prompt_tokens, index, parent=first)


def request(name: str, tokens, n: int = 1) -> Sequence:
    tokens = list(tokens)
    return Sequence(KVRequest(name, tokens), name, None, SamplingParams(max_tokens=4, n=n), len(tokens))


@pytest.fixture
def scheduler_on():
    """scheduler_on(slots, num_blocks=64, watermark=0.0, lookahead_tokens=0) -> Scheduler on a
    fresh manager (4-token pages; every request freed and the manager closed afterwards)."""
    managers = []

    def build(slots: int, num_blocks: int = 64, watermark: float = 0.0, lookahead_tokens: int = 0):
        manager = KVCacheManager(tiny_config(num_blocks=num_blocks, max_num_seqs=slots, max_model_len=128))
        managers.append(manager)
        config = EngineConfig(max_num_seqs=slots, max_model_len=128, max_num_batched_tokens=256,
                              watermark=watermark)
        return Scheduler(config, manager, new_fork, lookahead_tokens)

    yield build
    for manager in managers:
        assert_no_leaks(manager)
        close_manager(manager)


def carry_out(scheduler: Scheduler, plan, token: int = 99) -> None:
    """What the runner and the postprocessor do with a plan (no forward): commit, and each
    sequence whose prompt is computed and each planned child samples a token."""
    plan.kv.commit(plan.scheduled)
    for item in plan.scheduled:
        kv = item.seq.kv
        if kv.num_computed_tokens == len(kv.token_ids):
            kv.token_ids.append(token)
    for fork in plan.forks:
        for child in fork.children:
            child.kv.token_ids.append(token + 1 + child.index)
    scheduler.update(StepResult())


def test_forks_are_planned_with_the_prompts_last_chunk_within_the_free_slots(scheduler_on):
    scheduler = scheduler_on(slots=2)
    parent = request("a", range(1, 7), n=3)  # 6 tokens: each fork copies the partial last block
    scheduler.add(parent)
    plan = scheduler.schedule()
    assert [(fork.parent, [child.index for child in fork.children]) for fork in plan.forks] == [(parent, [1])]
    assert [seq.index for seq in scheduler.waiting] == [2]  # no slot left: waits as a new request
    assert [seq.index for seq in parent.sequences] == [0, 1, 2]
    carry_out(scheduler, plan)
    assert scheduler.manager.cache_stats().forks == 0  # the postprocessor forks nothing
    plan = scheduler.schedule()  # forks the planned child first, then grows both
    assert scheduler.manager.cache_stats().forks == 1 and plan.forks == []  # a group forks once
    assert [seq.index for seq in scheduler.running] == [0, 1]
    child = scheduler.running[1]
    assert child.kv.token_ids == list(range(1, 7)) + [101]  # its own sampled token, not the parent's
    assert [item.seq.index for item in plan.scheduled] == [0, 1]


@pytest.mark.parametrize("watermark,forks", [(0.0, 2), (0.25, 1), (0.5, 0)])
def test_forks_count_their_blocks_against_the_watermark(scheduler_on, watermark, forks):
    scheduler = scheduler_on(slots=3, num_blocks=4, watermark=watermark)  # 0.25 / 0.5: 1 / 2 kept free
    parent = request("a", range(1, 7), n=3)  # 2 blocks, and 1 for each fork
    scheduler.add(parent)
    plan = scheduler.schedule()
    assert sum(len(fork.children) for fork in plan.forks) == forks
    assert len(scheduler.waiting) == 2 - forks
    carry_out(scheduler, plan)
    scheduler.schedule()  # forks the planned children first; the decodes fit their blocks
    assert len(scheduler.running) == 1 + forks and scheduler.manager.cache_stats().forks == forks
    assert scheduler.manager.num_free_blocks >= scheduler.watermark_blocks  # the forks kept it


def test_lookahead_is_planned_by_the_scheduler_and_a_refused_mapping_gives_it_back(scheduler_on):
    scheduler = scheduler_on(slots=1, lookahead_tokens=1)
    seq = request("a", range(1, 8))  # 7 tokens: the first decode fills the second block
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert plan.lookahead == []  # a prefill gets none
    carry_out(scheduler, plan)  # the prefill's sampled token: its decode comes next
    free = scheduler.manager.num_free_blocks
    plan = scheduler.schedule()
    assert plan.lookahead, "the decode reaching a block's end gets the next block"
    assert scheduler.manager.num_free_blocks == free - 1
    scheduler.update(StepResult(refused_lookahead=plan.lookahead))
    assert scheduler.manager.num_free_blocks == free
    scheduler.manager.check()


def test_children_without_a_slot_wait_and_sample_the_same_greedy_tokens():
    from test_engine_correctness import assert_clean, assert_matches_hf, greedy, make_engine, prompts, run

    engine = make_engine(max_num_seqs=2)
    batch = prompts(1, lengths=(21,))
    outputs = run(engine, batch, greedy(n=3))
    assert len(outputs[0].outputs) == 3
    assert engine.manager.cache_stats().forks == 1  # the third waited for a slot
    assert_matches_hf("tiny-llama", batch, outputs)
    assert_clean(engine)
