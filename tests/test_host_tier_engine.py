"""The engine with a host tier: a shared prompt evicted from a small device pool is hit from host
memory later, with Hugging Face's greedy tokens and fewer prefill tokens computed than without
the tier; the tier's figures reach ``stats()`` and ``/metrics``."""

from __future__ import annotations

import functools

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.models.zoo import load_model

NEW_TOKENS = 8
SHARED = [(13 * j) % 250 + 1 for j in range(64)]  # four full 16-token pages
OTHERS = [[(31 * i + 7 * j) % 250 + 1 for j in range(60)] for i in range(1, 7)]


@functools.cache
def hf_greedy(prompt: tuple[int, ...]) -> list[int]:
    model, _ = load_model("tiny-llama", seed=0)
    model.set_attn_implementation("sdpa")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def chat(host_cache_bytes: int, kv_backend: str = "vmem", **options):
    """The shared prompt, then other traffic that needs the whole device pool, then the shared
    prompt with a new turn: (engine, its tokens of the last turn)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=128,
                                    num_blocks=12, host_cache_bytes=host_cache_bytes,
                                    kv_backend=kv_backend, **options))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    run_to_completion(engine, [("first", SHARED, params)])
    for i in range(0, len(OTHERS), 2):  # two at a time: 10 of the 12 blocks
        run_to_completion(engine, [(f"other{i + k}", OTHERS[i + k], params) for k in (0, 1)])
    turn = SHARED + [7, 8, 9]
    final = run_to_completion(engine, [("again", turn, params)])
    return engine, turn, final["again"].outputs[0].token_ids


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])  # the block-table baseline has it too
def test_an_evicted_shared_prompt_is_hit_from_the_host_tier_with_hf_tokens(kv_backend):
    plain, turn, plain_tokens = chat(0, kv_backend)
    tiered, _, tiered_tokens = chat(64 << 20, kv_backend)
    assert plain_tokens == tiered_tokens == hf_greedy(tuple(turn))
    without, with_tier = plain.manager.cache_stats(), tiered.manager.cache_stats()
    assert without.prefix_queried_tokens == with_tier.prefix_queried_tokens
    assert without.prefix_hit_tokens == 0  # the device pool forgot the shared prompt
    assert with_tier.prefix_hit_tokens_host == 64 and with_tier.host_promotions == 4
    computed_without = without.prefix_queried_tokens - without.prefix_hit_tokens
    computed_with = with_tier.prefix_queried_tokens - with_tier.prefix_hit_tokens
    assert computed_with == computed_without - 64
    stats = tiered.stats()
    assert stats["prefix_hit_tokens_host"] == 64 and stats["host_demotions"] >= 4
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(tiered.metrics.render().decode())
               for s in family.samples}
    assert samples[("vmemkv_prefix_cache_hit_tokens_total", (("tier", "host"),))] == 64
    assert samples[("vmemkv_host_cache_promotions_total", ())] == 4
    assert samples[("vmemkv_host_cache_copied_bytes_total", (("direction", "to_device"),))] == (
        4 * tiered.manager.block_bytes)
    for engine in (plain, tiered):
        engine.manager.check()
        assert engine.manager.num_blocks_in_use == 0


def test_host_cache_bytes_reaches_the_engine_and_its_cache_config():
    from vmemkv.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--host-cache-bytes", "1048576"])
    assert engine_config_from_args(args).host_cache_bytes == 1 << 20
    args = build_parser().parse_args(["generate", "--device", "cpu", "--prompt", "x"])
    assert engine_config_from_args(args).host_cache_bytes == 0
    model, _ = load_model("tiny-llama", seed=0)
    assert EngineConfig(host_cache_bytes=1 << 20).cache_config(model).host_cache_bytes == 1 << 20


@pytest.mark.spawns
def test_the_tier_under_tensor_parallelism_matches_hf():
    """Demotions and promotions go through the host block store that every rank replays, so
    each rank's host rows hold its own KV heads (ranks' mapping and host state compared every
    step)."""
    engine, turn, tokens = chat(64 << 20, tensor_parallel_size=2, tensor_parallel_check=True,
                                tensor_parallel_timeout=30)
    try:
        assert tokens == hf_greedy(tuple(turn))
        assert engine.manager.cache_stats().host_promotions == 4
        assert engine.tensor_parallel.failure is None
        engine.manager.check()
    finally:
        engine.close()
