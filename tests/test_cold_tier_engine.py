"""The engine with the lossy cold tier: a shared prompt evicted from a small device pool comes
back decompressed from the cold tier (fewer prefill tokens computed); a request asking for exact
KV (``kv_exact``) recomputes instead and gives Hugging Face's greedy tokens."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_host_tier_engine import NEW_TOKENS, OTHERS, SHARED, hf_greedy
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.errors import ConfigError


def chat(kv_exact: bool, **options):
    """The shared prompt, other traffic that needs the whole device pool, then the shared prompt
    with a new turn: (engine, the turn's prompt, its tokens)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=128, num_blocks=12,
                                    dtype="float32", **options))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    run_to_completion(engine, [("first", SHARED, params)])
    for i in range(0, len(OTHERS), 2):  # two at a time: 10 of the 12 blocks
        run_to_completion(engine, [(f"other{i + k}", OTHERS[i + k], params) for k in (0, 1)])
    turn = SHARED + [7, 8, 9]
    again = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, kv_exact=kv_exact)
    final = run_to_completion(engine, [("again", turn, again)])
    return engine, turn, final["again"].outputs[0].token_ids


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_shared_prompt_comes_back_from_the_cold_tier_and_an_exact_request_recomputes_it(fmt):
    cold = dict(kv_cold_tier=fmt, kv_cold_cache_bytes=16 << 20)
    lossy, turn, lossy_tokens = chat(False, **cold)
    stats = lossy.stats()
    assert stats["prefix_hit_tokens_cold"] == 64 and stats["cold_promotions"] == 4
    assert stats["cold_demotions"] >= 4 and stats["cold_blocks_cached"] >= 0
    assert len(lossy_tokens) == NEW_TOKENS  # close to HF's, not promised equal (a lossy hit)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(lossy.metrics.render().decode())
               for s in family.samples}
    assert samples[("vmemkv_prefix_cache_hit_tokens_total", (("tier", "cold"),))] == 64
    assert samples[("vmemkv_cold_cache_promotions_total", ())] == 4
    assert samples[("vmemkv_cold_cache_stored_bytes_total", ())] == stats["cold_bytes_stored"] > 0
    exact, _, exact_tokens = chat(True, **cold)
    assert exact_tokens == hf_greedy(tuple(turn))
    exact_stats = exact.stats()
    assert exact_stats["prefix_hit_tokens_cold"] == 0 and exact_stats["prefix_hit_tokens"] == 0
    for engine in (lossy, exact):
        engine.manager.check()
        assert engine.manager.num_blocks_in_use == 0


@pytest.mark.parametrize("kv_cache_dtype,fmt", [("int8", "int8"), ("int8", "int4"), ("fp8", "int4")])
def test_quantized_live_kv_goes_cold_and_comes_back_in_its_own_format(kv_cache_dtype, fmt):
    """int8 / fp8 live KV under the cold tier: the shared prompt's blocks are compressed from
    their rows and come back as rows of the live format (a hit on all 64 tokens); an exact
    request recomputes them."""
    cold = dict(kv_cold_tier=fmt, kv_cold_cache_bytes=16 << 20, kv_cache_dtype=kv_cache_dtype)
    for kv_exact in (False, True):
        engine, _, tokens = chat(kv_exact, **cold)
        stats = engine.stats()
        assert stats["kv_cache_dtype"] == kv_cache_dtype and len(tokens) == NEW_TOKENS
        assert stats["prefix_hit_tokens_cold"] == (0 if kv_exact else 64)
        assert stats["cold_demotions"] >= 4
        engine.manager.check()
        assert engine.manager.num_blocks_in_use == 0


def test_the_cold_tier_options_reach_the_cache_and_bad_ones_are_refused():
    from vmemkv.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--kv-cold-tier", "int4",
                                      "--kv-cold-cache-bytes", "1048576"])
    config = engine_config_from_args(args)
    assert (config.kv_cold_tier, config.kv_cold_cache_bytes) == ("int4", 1 << 20)
    with pytest.raises(ConfigError, match="cold_cache_bytes > 0"):
        LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, kv_cold_tier="int8"))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(model="tiny-llama", kv_cold_tier="int8", kv_cold_cache_bytes=1 << 20,
                     tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_exact"):
        SamplingParams(kv_exact="yes")
