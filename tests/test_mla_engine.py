"""Multi-head latent attention (MLA: tiny DeepSeek-V3, DeepSeek-V2, MiniCPM3 configs) in the
engine: the cache holds one latent row per token per layer (``kv_lora_rank + qk_rope_head_dim``
values), attention runs from those rows in the absorbed form, and the greedy tokens equal Hugging
Face ``generate`` with chunked prefill, prefix hits, ``n > 1`` and preemption by swap and by
recompute. Models vmemkv cannot serve this way are refused at load, before any KV memory."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from vmemkv.engine import SamplingParams
from vmemkv.engine.distributed.sharding import check_shardable
from vmemkv.engine.models.hf_support import check_attention_supported, kv_shape
from vmemkv.engine.models.zoo import model_config
from vmemkv.errors import ConfigError, UnsupportedModelError
from vmemkv.memory.layout import KVLayout

from test_engine_correctness import NEW_TOKENS, assert_clean, greedy, make_engine, prompts, reference_model, run

MLA_MODELS = ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-minicpm3"]
LATENT = 32 + 16  # the tiny configs' kv_lora_rank + qk_rope_head_dim


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    """HF's greedy tokens as ``ignore_eos`` gives them: ``</s>`` neither stops nor is suppressed
    (``min_new_tokens`` would suppress it, and these models do pick it)."""
    out = reference_model(name).generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_matches_hf(name: str, token_prompts, outputs) -> None:
    for prompt, output in zip(token_prompts, outputs):
        for completion in output.outputs:
            assert completion.token_ids == hf_greedy(name, tuple(prompt)), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("model,layout", [(name, "token_major") for name in MLA_MODELS]
                         + [("tiny-deepseek-v3", "per_layer")])
def test_ragged_chunked_batch_matches_hf_from_latent_rows(model, layout):
    engine = make_engine(model, max_num_batched_tokens=16, layout=layout)
    batch = prompts(4, lengths=(5, 40, 17, 33))
    assert_matches_hf(model, batch, run(engine, batch))
    k_view, v_view = engine.manager.kv_views(0)
    assert k_view.shape[-2:] == (1, LATENT) and v_view.data_ptr() == k_view.data_ptr()
    assert engine.stats()["kv_bytes_per_token_per_layer"] == LATENT * 4  # float32
    assert f"vmemkv_kv_bytes_per_token_per_layer {float(LATENT * 4)}" in engine.metrics.render().decode()
    assert type(engine.manager.groups[0].spec).__name__ == "MLALatentSpec"
    assert_clean(engine)


def test_the_slot_holds_the_models_latent_rows_contiguously():
    """After a prefill, a request's rows of each layer are ``[c_kv after its norm | rope'd k_pe]``,
    what transformers' own cache receives, read as one strided view of its slot."""
    name, prompt = "tiny-deepseek-v3", prompts(1, lengths=(21,))[0]
    engine = make_engine(name)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0]
    hf = reference_model(name)(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(3):
        rows = engine.manager.kv_views(layer)[0][seq.kv.slot, :len(prompt), 0]  # in place
        assert rows.stride(-1) == 1
        expected = torch.cat([hf.layers[layer].keys[0, 0], hf.layers[layer].values[0, 0]], dim=-1)
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
    engine.abort_request("a")
    engine.step()
    assert_clean(engine)


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-minicpm3"])
def test_prefix_hits_match_hf(model):
    engine = make_engine(model)
    page = engine.manager.tokens_per_page
    system = prompts(1, lengths=(2 * page + 5,), offset=5)[0]
    batch = [system + tail for tail in prompts(3, lengths=(3, 11, 7))]
    first = run(engine, batch[:1])
    rest = run(engine, batch[1:])
    assert all(output.num_cached_tokens == 2 * page for output in rest)
    assert_matches_hf(model, batch, first + rest)
    assert_clean(engine)


def test_weights_read_by_the_absorbed_form_stay_unpacked_and_survive_sleep():
    engine = make_engine("tiny-deepseek-v2")
    attention = engine.runner.model_runner.model.model.layers[0].self_attn
    assert type(attention.kv_b_proj) is torch.nn.Linear  # its weight is read, not multiplied by
    batch = prompts(2, lengths=(21, 9))
    assert_matches_hf("tiny-deepseek-v2", batch, run(engine, batch))
    engine.sleep(2)  # the weights are dropped, then loaded again
    engine.wake_up()
    assert_matches_hf("tiny-deepseek-v2", batch, run(engine, batch))
    assert_clean(engine)


def test_parallel_sampling_greedy_forks_match_hf():
    engine = make_engine("tiny-deepseek-v2")
    batch = prompts(2, lengths=(37, 21))
    outputs = run(engine, batch, greedy(n=3))
    assert all(len(output.outputs) == 3 for output in outputs)
    assert engine.manager.cache_stats().forks == 4
    assert_matches_hf("tiny-deepseek-v2", batch, outputs)
    assert_clean(engine)


@pytest.mark.parametrize("model,mode", [("tiny-deepseek-v3", "swap"), ("tiny-deepseek-v3", "recompute"),
                                        ("tiny-deepseek-v2", "swap"), ("tiny-minicpm3", "recompute")])
def test_preemption_matches_hf(model, mode):
    assert_preemption_matches_hf(model, mode, enable_prefix_caching=False)


def assert_preemption_matches_hf(model: str, mode: str, **options) -> None:
    """Six sequences on a pool too small for all of them: preempted by ``mode`` (at least once),
    every one's greedy tokens still HF's."""
    probe = make_engine(model)
    page = probe.manager.tokens_per_page
    probe.close()
    # 12 pages for 6 sequences of 2 pages that each grow into a third: someone must wait
    engine = make_engine(model, num_blocks=12, preemption_mode=mode, watermark=0.0,
                         max_num_batched_tokens=4 * page, **options)
    batch = prompts(6, lengths=tuple(2 * page - 12 + k for k in (0, 3, 7, 1, 5, 6)))
    outputs = run(engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = engine.manager.cache_stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, tuple(prompt), 20)
    assert_clean(engine)


@pytest.mark.parametrize("kind", ["token_major", "per_layer"])
def test_a_latent_layout_holds_one_row_per_token_per_layer(kind):
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=LATENT, dtype=torch.bfloat16,
                      page_size=3 * LATENT * 2 * 64, kind=kind, latent=True)
    assert layout.kv_bytes_per_token_per_layer == LATENT * 2
    assert layout.token_bytes == 3 * LATENT * 2  # not 2 x: no separate V
    assert layout.pages_per_block == (1 if kind == "token_major" else 3)
    for layer in range(3):  # K and V are the same row
        assert layout.slot_view_geometry(layer, 0, 256) == layout.slot_view_geometry(layer, 1, 256)
    tensor_elems = layout.logical_pages_for(256) * layout.page_size // 2  # per_layer: one tensor a layer
    assert layout.slot_view_geometry(2, 0, 256)[1] == 2 * (LATENT if kind == "token_major" else tensor_elems)


def test_kv_shape_comes_from_the_models_own_shapes():
    config = model_config("tiny-deepseek-v3")
    assert config.head_dim == 16  # the rope part only: K is 48 wide, V 32
    assert kv_shape(config) == (3, 1, LATENT)
    odd = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16)
    odd.v_head_dim = 32
    with pytest.raises(UnsupportedModelError, match="values have 32 dims per head and its keys 16"):
        kv_shape(odd)


def test_block_tables_kernels_tensor_parallel_and_other_latent_models_are_refused_at_load():
    with pytest.raises(UnsupportedModelError, match="kv_backend='vmem'"):
        make_engine("tiny-deepseek-v3", kv_backend="paged")
    with pytest.raises(ConfigError, match="attention='native'.*absorbed form.*use attention='auto'"):
        make_engine("tiny-deepseek-v3", attention="native")
    with pytest.raises(UnsupportedModelError, match="latent row.*tensor_parallel_size=1"):
        check_shardable(model_config("tiny-deepseek-v3"), 2)
    other = model_config("tiny-deepseek-v3")
    other.model_type = "glm4_moe_lite"  # MLA through another attention module
    for replaces_attention in (True, False):  # the engine, VmemkvCache
        with pytest.raises(UnsupportedModelError, match="multi-head latent attention.*deepseek_v3"):
            check_attention_supported(other, 64, replaces_attention=replaces_attention)


@pytest.mark.parametrize("kind,words", [("mamba", "Mamba / SSM state"),
                                        ("linear_attention", "gated delta net"),
                                        ("conv", "short convolution")])
def test_state_layers_are_refused_naming_their_kind(kind, words):
    config = SimpleNamespace(model_type="hybrid", num_hidden_layers=2, layer_types=[kind, "full_attention"])
    with pytest.raises(UnsupportedModelError, match=words) as refusal:
        check_attention_supported(config, 8, replaces_attention=True)
    assert "only full attention" not in str(refusal.value)
