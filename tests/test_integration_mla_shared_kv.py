"""``VmemkvCache`` on models whose cache is not one K and one V row per head per token:

* multi-head latent attention (tiny DeepSeek-V3, DeepSeek-V2, MiniCPM3): transformers hands
  ``update()`` the latent (the compressed KV after its norm, and the rope'd shared key), which the
  cache holds as one latent row per token per layer; ``generate`` gives DynamicCache's tokens,
  greedy, with beams (blocks remapped) and with a prefix reused across calls;
* Gemma-3n's KV-shared layers, which reuse an earlier layer's K/V and never call ``update()``:
  the cache holds only the layers before them, and gives DynamicCache's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3nTextConfig

from vmemkv.engine.models.zoo import load_model
from vmemkv_transformers import VmemkvCache, cache_kwarg

MLA_MODELS = ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-minicpm3"]


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, input_ids, cache=None, **kwargs) -> torch.Tensor:
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    return model.generate(input_ids, max_new_tokens=16, **kwargs)


def checked_close(cache: VmemkvCache) -> None:
    cache.manager.check()
    cache.release()
    assert cache.manager.num_blocks_in_use == 0
    cache.close()


@pytest.fixture(scope="module", params=MLA_MODELS)
def mla_model(request):
    model, _ = load_model(request.param)
    model.generation_config.eos_token_id = None  # </s> neither stops nor is suppressed
    model.generation_config.pad_token_id = 0
    return model


def test_mla_latent_rows_greedy_and_beams_match_dynamic_cache(mla_model):
    cache = VmemkvCache.from_model(mla_model, max_batch_size=8, max_cache_len=256)
    layout = cache.manager.layout
    assert layout.latent and layout.kv_bytes_per_token_per_layer == (32 + 16) * 4  # not 4 x (48 + 32) x 4
    batch = ids(2, 37)
    assert torch.equal(generate(mla_model, batch, cache, do_sample=False),
                       generate(mla_model, batch, do_sample=False))
    assert cache.layers[0].keys.shape[-1] == 32 and cache.layers[0].values.shape[-1] == 16
    cache.release()
    assert torch.equal(generate(mla_model, batch[:1], cache, do_sample=False, num_beams=3),
                       generate(mla_model, batch[:1], do_sample=False, num_beams=3))
    checked_close(cache)


def test_mla_prefix_reuse_computes_less_and_matches(mla_model):
    cache = VmemkvCache.from_model(mla_model, max_batch_size=4, max_cache_len=256)
    page = cache.manager.tokens_per_page
    system = ids(1, page + 5, seed=7)
    first = torch.cat([system, ids(1, 4, seed=8)], dim=1)
    second = torch.cat([system, ids(1, 9, seed=9)], dim=1)
    cache.generate(first, max_new_tokens=8, do_sample=False)
    cache.release()
    out = cache.generate(second, max_new_tokens=8, do_sample=False)
    assert cache.last_call["cached_tokens"] == page
    assert torch.equal(out, mla_model.generate(second, max_new_tokens=8, do_sample=False))
    checked_close(cache)


def tiny_gemma3n() -> torch.nn.Module:
    """Four layers (local, global, local, global); the last two reuse the first two's K/V."""
    config = Gemma3nTextConfig(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_size_per_layer_input=8, sliding_window=8, num_kv_shared_layers=2, laurel_rank=8,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        max_position_embeddings=512, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def test_gemma3n_kv_shared_layers_are_not_held_and_generate_matches():
    model = tiny_gemma3n()
    cache = VmemkvCache.from_model(model, max_batch_size=4, max_cache_len=256)
    assert cache.manager.config.num_layers == 2  # the layers that call update()
    batch = ids(2, 21)  # longer than the window of 8: the local layer releases blocks
    assert torch.equal(generate(model, batch, cache, do_sample=False), generate(model, batch, do_sample=False))
    cache.release()
    torch.manual_seed(5)
    want = generate(model, batch, do_sample=True, top_k=0, temperature=1.5)
    torch.manual_seed(5)
    got = generate(model, batch, cache, do_sample=True, top_k=0, temperature=1.5)
    assert torch.equal(got, want)
    assert len(set(got[0, 21:].tolist())) > 4  # sampled tokens vary (greedy ones repeat here)
    checked_close(cache)
