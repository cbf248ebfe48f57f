"""Attention vmemkv cannot reproduce is refused at load time, by the engine and by ``VmemkvCache``
alike, with an ``UnsupportedModelError`` that names the model, the feature and the fix.

Sliding windows (local and global layers), logit soft-capping and sinks are reproduced at any
length (``test_sliding_window_models`` checks the tokens) and accepted. An attention chunk of W
tokens never takes effect while no sequence is longer than W, so a max length <= W is accepted;
the engine also refuses what its own attention does not apply (ALiBi, bidirectional attention),
which ``VmemkvCache`` leaves to the model's attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          Llama4TextConfig, LlavaConfig, MistralConfig, PretrainedConfig, Qwen2Config)

import vmemkv
from vmemkv_transformers import VmemkvCache
from vmemkv.engine import EngineConfig, LLMEngine
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.core.model_runner import _attention
from vmemkv.engine.models.zoo import byte_tokenizer
from vmemkv.engine.core.sampling_params import SamplingParams
from vmemkv.errors import UnsupportedModelError
from vmemkv.engine.models.hf_support import check_attention_supported, layer_kinds

WINDOW = 16
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=256, eos_token_id=257, pad_token_id=0)


def mistral() -> PretrainedConfig:  # no layer_types: the window applies on every layer
    return MistralConfig(sliding_window=WINDOW, **SHAPE)


def qwen2() -> PretrainedConfig:  # slides from layer max_window_layers up
    return Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SHAPE)


def gemma2(**overrides) -> PretrainedConfig:
    return Gemma2Config(sliding_window=WINDOW, head_dim=16, **{**SHAPE, **overrides})


def llama_layer_types() -> PretrainedConfig:
    return LlamaConfig(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                       **SHAPE)


# name, config, its sliding layers
WINDOWED = [("mistral", mistral, [0, 1]), ("qwen2", qwen2, [1]), ("gemma2", gemma2, [0]),
            ("llama", llama_layer_types, [0])]


def build(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def engine_for(model, max_model_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=max_model_len), model=model,
                     tokenizer=byte_tokenizer())


@pytest.mark.parametrize("name,config,layers", WINDOWED, ids=[w[0] for w in WINDOWED])
def test_windows_shorter_than_max_len_are_accepted(name, config, layers):
    kinds = layer_kinds(config())
    assert [i for i, kind in enumerate(kinds) if kind == "sliding_attention"] == layers
    model = build(config())  # gemma2 with its logit soft-capping
    VmemkvCache.from_model(model, max_batch_size=1, max_cache_len=4 * WINDOW).close()
    engine_for(model, max_model_len=4 * WINDOW).close()
    check_attention_supported(config(), 4 * WINDOW, replaces_attention=True)


def test_engine_refuses_bidirectional_attention_the_cache_leaves_to_the_model():
    model = build(Gemma3TextConfig(sliding_window=WINDOW, head_dim=16, use_bidirectional_attention=True,
                                   **SHAPE))
    with pytest.raises(UnsupportedModelError, match="gemma3_text model.*bidirectional attention"):
        engine_for(model, max_model_len=4 * WINDOW)
    VmemkvCache.from_model(model, max_batch_size=1, max_cache_len=4 * WINDOW).close()


def test_engine_refuses_alibi():
    config = SimpleNamespace(model_type="mpt", num_hidden_layers=2, num_attention_heads=4,
                             attn_config=SimpleNamespace(alibi=True))
    with pytest.raises(UnsupportedModelError, match="mpt model.*ALiBi position biases"):
        check_attention_supported(config, 64, replaces_attention=True)
    check_attention_supported(config, 64, replaces_attention=False)


def test_accepted_mistral_matches_hf_generate():
    model = build(mistral())
    prompt = [(7 * i) % 250 + 1 for i in range(6)]
    params = SamplingParams(max_tokens=WINDOW - len(prompt), temperature=0, ignore_eos=True)
    engine = engine_for(model, max_model_len=WINDOW)
    got = run_to_completion(engine, [("0", prompt, params)])["0"].outputs[0].token_ids
    engine.close()
    model.set_attn_implementation("sdpa")
    want = model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                          min_new_tokens=params.max_tokens, do_sample=False, pad_token_id=0)
    assert got == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", [
    lambda: LlamaConfig(**SHAPE),
    lambda: Qwen2Config(**SHAPE),  # use_sliding_window=False by default
    lambda: Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **SHAPE),
], ids=["llama", "qwen2-no-window", "qwen2-window-above-every-layer"])
def test_full_attention_models_pass(config):
    model = build(config())
    engine_for(model, max_model_len=256).close()
    VmemkvCache.from_model(model, max_batch_size=1, max_cache_len=256).close()


def test_composite_configs_are_read_through_their_text_config():
    text = LlamaConfig(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=WINDOW,
                       **SHAPE)
    config = LlavaConfig(text_config=text.to_dict())
    with pytest.raises(UnsupportedModelError, match="llama model.*chunked attention of 16"):
        check_attention_supported(config, 64, replaces_attention=False)
    check_attention_supported(config, WINDOW, replaces_attention=False)


def test_chunked_and_non_attention_layers():
    chunked = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=WINDOW)
    with pytest.raises(UnsupportedModelError, match="chunked attention of 16 tokens on layers 0-2"):
        check_attention_supported(chunked, 64, replaces_attention=False)
    check_attention_supported(chunked, WINDOW, replaces_attention=False)
    hybrid = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="'linear_attention' layers"):
        check_attention_supported(hybrid, 8, replaces_attention=False)


def test_error_type_and_runtime_backstop():
    assert issubclass(vmemkv.UnsupportedModelError, vmemkv.VmemkvError)
    assert issubclass(UnsupportedModelError, ValueError)
    # A model the config check does not know still cannot pass the engine's attention ALiBi.
    q = torch.zeros(1, 4, 1, 16)
    module = SimpleNamespace(layer_idx=0)
    with pytest.raises(UnsupportedModelError, match="'alibi'"):
        _attention(module, q, q, q, None, 0.25, alibi=torch.zeros(4), vmemkv_attention=object())
