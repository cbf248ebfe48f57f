"""Llama-4-style chunked local attention gives Hugging Face's greedy tokens through the engine at
any length (both KV backends, chunked prefill, prefix hits, preemption by swap and recompute).

Tiny random-weight ``Llama4ForCausalLM`` models (MoE, q/k norms) with chunks of 5 tokens against
sequences of up to ~30 and blocks of 4, so chunk boundaries fall inside blocks: one whose every
layer is chunked (the engine gives back the blocks of finished chunks,
``CacheConfig.attention_chunk_size``), and Llama-4's own mix of three chunked layers to one global
NoPE layer (two layer groups of one ``KVCacheManager``: the chunked layers' group gives back its
finished chunks while the global group keeps every block).
``test_the_references_depend_on_the_chunk`` shows a path that ignored the chunks would fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig, LlamaConfig

from vmemkv.engine import LLMEngine
from vmemkv.errors import UnsupportedModelError
from vmemkv.cache.attention_spec import CHUNKED, AttentionSpec
from vmemkv.engine.models.hf_support import check_attention_supported, layer_chunks, uniform_chunk

from test_sliding_window_models import close_clean, run_model

CHUNK = 5
NEW_TOKENS = 12
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=256,
             initializer_range=0.1, bos_token_id=256, eos_token_id=None, pad_token_id=0)
MODELS = {"every-layer-chunked": [1, 1, 1, 1], "llama4-mix": [1, 1, 1, 0]}  # no_rope_layers
PROMPT_LENGTHS = (3, 9, 14, 6)


def build(name: str, chunk: int = CHUNK) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Llama4TextConfig(**SHAPE, attention_chunk_size=chunk, no_rope_layers=MODELS[name])
    return Llama4ForCausalLM(config).eval()


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], chunk: int = CHUNK) -> list[int]:
    out = build(name, chunk).generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(31 * i + 7 * j) % 250 + 1 for j in range(length)] for i, length in enumerate(lengths)]


def run_engine(name: str, batch, **config) -> tuple[LLMEngine, list[list[int]]]:
    return run_model(build(name), batch, NEW_TOKENS, **config)


def assert_matches_hf(name: str, batch, got) -> None:
    for prompt, tokens in zip(batch, got):
        assert tokens == hf_greedy(name, tuple(prompt)), f"{name}: prompt of {len(prompt)} tokens diverged"


def test_the_references_depend_on_the_chunk():
    batch = prompts()
    for name in MODELS:
        assert any(hf_greedy(name, tuple(p)) != hf_greedy(name, tuple(p), chunk=64) for p in batch), name


def test_layer_chunks_and_what_the_engine_and_vmemkvcache_accept():
    mixed, every = build("llama4-mix").config, build("every-layer-chunked").config
    assert layer_chunks(mixed) == [CHUNK, CHUNK, CHUNK, None] and uniform_chunk(mixed) is None
    assert uniform_chunk(every) == CHUNK
    check_attention_supported(mixed, 64, replaces_attention=True)  # the engine applies chunks
    with pytest.raises(UnsupportedModelError, match="chunked attention of 5 tokens"):
        check_attention_supported(mixed, 64, replaces_attention=False)  # VmemkvCache: <= chunk
    with pytest.raises(UnsupportedModelError, match="temperature tuning on NoPE layers"):
        check_attention_supported(mixed, 8192, replaces_attention=True)  # floor_scale: 8192
    with pytest.raises(UnsupportedModelError, match="packs up to 8192 tokens"):
        check_attention_supported(mixed, 64, replaces_attention=True, max_packed_tokens=8192)
    check_attention_supported(mixed, 8191, replaces_attention=True, max_packed_tokens=2048)
    # Llama's own code attends chunked layers in full: the engine keeps to the bounded rule there.
    llama = LlamaConfig(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"],
                        attention_chunk_size=CHUNK)
    assert layer_chunks(llama) is None
    with pytest.raises(UnsupportedModelError, match="chunked attention of 5 tokens"):
        check_attention_supported(llama, 64, replaces_attention=True)


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_matches_hf_with_chunked_prefill(name, kv_backend):
    batch = prompts()
    engine, got = run_engine(name, batch, kv_backend=kv_backend, max_num_batched_tokens=8)
    assert_matches_hf(name, batch, got)
    groups = engine.manager.layout_groups
    if name == "llama4-mix":  # the global NoPE layer, then the chunked layers
        assert len(groups) == 2 and not groups[0].spec.releases
        assert groups[1].spec == AttentionSpec(CHUNKED, CHUNK) and groups[1].layers == (0, 1, 2)
    else:  # one group of every layer, chunked
        assert len(groups) == 1 and groups[0].spec == AttentionSpec(CHUNKED, CHUNK)
    assert engine.manager.cache_stats().blocks_released_behind_window > 0
    close_clean(engine)


def test_without_release_every_block_is_kept_and_the_tokens_are_the_same():
    batch = prompts()
    engine, got = run_engine("llama4-mix", batch, release_behind_window=False)
    assert_matches_hf("llama4-mix", batch, got)
    assert engine.manager.cache_stats().blocks_released_behind_window == 0
    close_clean(engine)


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_engine_matches_hf_with_prefix_hits_and_blocks_of_finished_chunks_released(kv_backend):
    shared = [(11 * j) % 250 + 1 for j in range(13)]
    batch = [shared + [200 + i] * (i + 1) for i in range(4)]
    engine, got = run_engine("every-layer-chunked", batch, kv_backend=kv_backend, max_num_seqs=1)
    assert_matches_hf("every-layer-chunked", batch, got)
    assert engine.manager.cache_stats().prefix_hit_tokens > 0
    close_clean(engine)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("name,num_blocks", [("every-layer-chunked", 5), ("llama4-mix", 8)])
def test_engine_matches_hf_under_preemption(name, num_blocks, preemption):
    # Four sequences growing to 23-26 tokens in prefill chunks of 4: the mix holds every block
    # (7 each), the chunked model about a chunk and a block; either way someone is preempted.
    batch = prompts((14, 13, 12, 11))
    engine, got = run_engine(name, batch, num_blocks=num_blocks, preemption_mode=preemption,
                             enable_prefix_caching=False, watermark=0.0, max_num_batched_tokens=4)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(name, batch, got)
    close_clean(engine)
