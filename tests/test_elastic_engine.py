"""Elastic KV memory in the engine (engine/core/elastic.py): an idle engine gives its free KV
memory back once per idle spell and never while it works; sleep gives back every page (and level 2
the weights), refuses while requests run, and after wake_up greedy tokens are what they were;
two engines on one shared budget; the server's /sleep, /wake_up and /is_sleeping, and its
/metrics gauges. The real engine on tiny-llama."""

from __future__ import annotations

import uuid

import pytest
import torch

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.elastic import EngineAsleepError
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.errors import ConfigError, RequestStateError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[(11 * i + 5 * r) % 500 + 1 for i in range(60)] for r in range(4)]


@pytest.fixture(autouse=True)
def pool_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VMEMKV_KV_POOL_DIR", str(tmp_path))


@pytest.fixture
def engines():
    made = []

    def make(**config) -> LLMEngine:
        made.append(LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=8, **config), stream=False))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def generate(engine: LLMEngine, prompts=PROMPTS, tag: str = "") -> list[list[int]]:
    final = run_to_completion(engine, [(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)])
    return [final[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]


def resident(engine: LLMEngine) -> int:
    return engine.stats()["kv_bytes_resident"]


def test_an_idle_engine_gives_its_memory_back_once_and_never_while_busy(engines):
    engine = engines(kv_idle_release_s=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    assert engine.seconds_to_idle_release() is None and engine.on_idle() == 0  # busy: nothing
    while engine.has_unfinished_requests():
        engine.step()
    peak = resident(engine)
    assert peak > 0 and engine.seconds_to_idle_release() == 0
    assert engine.on_idle() == peak  # every block: the finished ones' cached blocks too
    assert resident(engine) == 0
    assert engine.on_idle() == 0 and engine.seconds_to_idle_release() is None  # once per spell
    assert generate(engine, tag="again") == generate(engines(), tag="ref")  # it runs on as before
    assert engine.stats()["idle_releases"] == 1


def test_without_a_kv_pool_or_a_delay_nothing_is_given_back(engines):
    engine = engines()
    generate(engine)
    assert engine.seconds_to_idle_release() is None and engine.on_idle() == 0
    assert resident(engine) > 0


@pytest.mark.parametrize("level, model", [(1, "tiny-llama"), (2, "tiny-llama"), (2, "tiny-qwen2")])
def test_sleep_gives_back_every_page_and_wake_up_restores_the_same_tokens(engines, level, model):
    """Level 2 on CPU drops the packed linear weights too (buffers; tiny-qwen2 runs with fused
    projections, whose q|k|v bias is a parameter of the fused layer), and the wake builds them the
    same way again."""
    engine = engines(model=model, fused_projections=model == "tiny-qwen2")
    before = generate(engine)
    assert engine.sleep(level) > 0
    assert resident(engine) == 0 and engine.sleep_level == level
    if level == 2:  # the weights are gone until wake_up loads them again
        weights = engine.runner.model_runner.model
        assert engine.packed_linears.startswith("packed")
        assert all(tensor.numel() == 0 for tensor in [*weights.parameters(), *weights.buffers()])
    with pytest.raises(EngineAsleepError, match="wake_up"):
        engine.add_request("late", PROMPTS[0], GREEDY)
    engine.wake_up()
    assert engine.sleep_level == 0
    assert generate(engine, tag="woken") == before


def test_sleep_is_refused_while_requests_run_and_changes_nothing(engines):
    engine = engines()
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    held = resident(engine)
    with pytest.raises(RequestStateError, match="unfinished"):
        engine.sleep()
    with pytest.raises(ConfigError, match="level"):
        engines().sleep(3)
    assert resident(engine) == held and engine.sleep_level == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_level_2_needs_a_model_it_can_load_again():
    from vmemkv.engine.models.zoo import load_model
    model, tokenizer = load_model("tiny-llama", torch.float32, "cpu", 0)
    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=2), model, tokenizer, stream=False)
    try:
        with pytest.raises(ConfigError, match="level=1"):
            engine.sleep(2)
        assert engine.sleep(1) >= 0 and engine.sleep_level == 1
        engine.wake_up()
    finally:
        engine.close()


def test_two_engines_share_one_budget(engines):
    """Each engine alone fits its burst in the budget; one at a time, with the idle give-back
    between, both run with no preemption and together never hold more than the budget."""
    pool = f"t-{uuid.uuid4().hex[:8]}"
    probe = engines()
    generate(probe)
    need = probe.stats()["peak_kv_bytes"]
    budget = need * 3 // 2  # more than one burst needs, less than two
    first = engines(kv_pool=pool, kv_pool_bytes=budget, kv_idle_release_s=0)
    second = engines(kv_pool=pool, kv_idle_release_s=0)
    reference = generate(probe, tag="ref")
    for round_ in range(2):
        for engine in (first, second):
            assert generate(engine, tag=f"{round_}.") == reference
            stats = engine.stats()
            assert stats["kv_pool_used_bytes"] <= budget and stats["preemptions"] == 0
            engine.on_idle()  # idle now: its share goes back for the other
            assert engine.stats()["kv_pool_share_bytes"] == 0


def test_kv_pool_options_are_checked():
    with pytest.raises(ConfigError, match="kv_idle_release_s"):
        EngineConfig(kv_idle_release_s=-1)
    assert EngineConfig(kv_pool="p").idle_release_seconds == 1.0
    assert EngineConfig().idle_release_seconds is None
