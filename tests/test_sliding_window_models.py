"""Models with sliding windows, local and global layers, logit soft-capping and attention sinks give
Hugging Face's greedy tokens through the engine (both KV backends, chunked prefill, prefix hits,
preemption by swap and recompute) and through ``VmemkvCache``.

Tiny random-weight models built from configs, with windows of 3 tokens against sequences of up to
24, so every local layer slides: Mistral (every layer local), Qwen2 with ``use_sliding_window``
(local from ``max_window_layers`` up), Gemma-2 (alternating local/global, soft-capping), Gemma-3
text (local/global, q/k norms, its own local RoPE base), GPT-OSS (sinks, local/global, MoE).
``test_the_models_are_sensitive_to_each_feature`` shows the references depend on the window,
the cap and the sinks, so a path that dropped one would fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GptOssConfig,
                          MistralConfig, Qwen2Config)

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.models.zoo import byte_tokenizer
from vmemkv_transformers import VmemkvCache, cache_kwarg

WINDOW = 3
NEW_TOKENS = 10
# eos_token_id None: HF generate runs the full NEW_TOKENS, as the engine's ignore_eos does.
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=256, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=False)
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
CONFIGS = {  # name: (config class, what it adds to SHAPE)
    "mistral": (MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2": (Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": (Gemma2Config, dict(sliding_window=WINDOW, attn_logit_softcapping=1.0, **GEMMA)),
    "gemma3": (Gemma3TextConfig, dict(sliding_window=WINDOW, layer_types=LOCAL_GLOBAL, **GEMMA)),
    "gpt_oss": (GptOssConfig, dict(sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                   layer_types=LOCAL_GLOBAL,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
PROMPT_LENGTHS = (3, 9, 14, 6)


def build(name: str, **overrides) -> torch.nn.Module:
    """A fresh model (and config object: models built from one config share it), seed 0."""
    torch.manual_seed(0)
    config_class, specific = CONFIGS[name]
    model = AutoModelForCausalLM.from_config(config_class(**{**SHAPE, **specific, **overrides})).eval()
    model.set_attn_implementation("eager")  # SDPA has no soft-capping or sinks
    return model


@functools.cache
def reference(name: str) -> torch.nn.Module:
    return build(name)


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...]) -> list[int]:
    out = reference(name).generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(lengths=PROMPT_LENGTHS, offset: int = 0) -> list[list[int]]:
    return [[(31 * (i + offset) + 7 * j) % 250 + 1 for j in range(length)] for i, length in enumerate(lengths)]


def run_engine(name: str, batch, **config) -> tuple[LLMEngine, list[list[int]]]:
    return run_model(build(name), batch, **config)


def run_model(model, batch, new_tokens: int = NEW_TOKENS, **config) -> tuple[LLMEngine, list[list[int]]]:
    """The engine's ``new_tokens`` greedy tokens for ``batch`` on ``model`` (4 slots, 4-token
    blocks unless ``config`` says otherwise)."""
    options = dict(max_num_seqs=4, max_model_len=64, tokens_per_page=4, swap_space_bytes=1 << 20)
    engine = LLMEngine(EngineConfig(**{**options, **config}), model=model, tokenizer=byte_tokenizer())
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(batch)])
    return engine, [final[str(i)].outputs[0].token_ids for i in range(len(batch))]


def assert_matches_hf(name: str, batch, got) -> None:
    for prompt, tokens in zip(batch, got):
        assert tokens == hf_greedy(name, tuple(prompt)), f"{name}: prompt of {len(prompt)} tokens diverged"


def close_clean(engine: LLMEngine) -> None:
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0
    engine.close()


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_matches_hf_with_chunked_prefill(name, kv_backend):
    batch = prompts()
    engine, got = run_engine(name, batch, kv_backend=kv_backend, max_num_batched_tokens=8)
    assert_matches_hf(name, batch, got)
    close_clean(engine)


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_engine_batched_decodes_read_from_the_window_start(kv_backend, monkeypatch):
    """Decodes of equal length are attended in one call from their common window start (CPU;
    ragged ones go one by one, as in the tests above: ``DecodeBatch.window``)."""
    from vmemkv.attention.slot_batch import DecodeBatch

    reads = []
    window = DecodeBatch.window
    monkeypatch.setattr(DecodeBatch, "window", lambda self, w: reads.append(window(self, w)) or reads[-1])
    batch = prompts((9, 9, 9, 9))
    engine, got = run_engine("gemma2", batch, kv_backend=kv_backend, attention="sdpa")
    assert_matches_hf("gemma2", batch, got)
    assert any(read is not None and read[0] > 0 for read in reads)  # read from the window start
    close_clean(engine)


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_engine_prefix_hits_match_hf(name, kv_backend):
    # 33 tokens: 32 in whole pages of 8 (both layers) or 16 tokens (one layer's group, Gemma-2's
    # local and global layers apart on vmem, whose local pages behind the window are released)
    system = prompts((33,), offset=5)[0]
    batch = [system + tail for tail in prompts((2, 5, 3))]
    engine, first = run_engine(name, batch[:1], kv_backend=kv_backend)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(batch[1:])])
    rest = [final[str(i)] for i in range(len(batch) - 1)]
    assert all(output.num_cached_tokens == 32 for output in rest)
    assert_matches_hf(name, batch, first + [output.outputs[0].token_ids for output in rest])
    close_clean(engine)


@pytest.mark.parametrize("mode,kv_backend", [("swap", "vmem"), ("recompute", "vmem"), ("swap", "paged")])
def test_engine_preemption_matches_hf(mode, kv_backend):
    # 8 pages of 4 tokens for 4 sequences that each grow to 5-6 pages: someone must wait.
    batch = prompts((12, 14, 9, 13))
    engine, got = run_engine("gemma2", batch, kv_backend=kv_backend, num_blocks=8, preemption_mode=mode,
                             enable_prefix_caching=False, watermark=0.0)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf("gemma2", batch, got)
    close_clean(engine)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vmemkv_cache_matches_hf_generate(name):
    model = build(name)
    batch = prompts()[1:3]
    with VmemkvCache.from_model(model, max_batch_size=2, max_cache_len=64, tokens_per_page=4) as cache:
        for prompt in batch:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 **{cache_kwarg(model): cache})
            assert out[0, len(prompt):].tolist() == hf_greedy(name, tuple(prompt))
            cache.release()
        # a prompt continuing the last sequence reuses its pages (a hybrid model's groups hold 16
        # tokens a page: the sequence, not only its prompt, fills one) and still matches
        shared = out[0].tolist() + [5, 6, 7]
        out = cache.generate(torch.tensor([shared]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert cache.last_call["cached_tokens"] > 0
        assert out[0, len(shared):].tolist() == hf_greedy(name, tuple(shared))
        cache.manager.check()


@pytest.mark.parametrize("name,change", [("mistral", dict(sliding_window=64)),
                                         ("gemma3", dict(sliding_window=64)),
                                         ("qwen2", dict(use_sliding_window=False)),
                                         ("gemma2", dict(attn_logit_softcapping=None))],
                         ids=["mistral-window", "gemma3-window", "qwen2-window", "gemma2-softcap"])
def test_the_models_are_sensitive_to_each_feature(name, change):
    batch = prompts()
    without = build(name, **change)
    differs = []
    for prompt in batch:
        out = without.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        differs.append(out[0, len(prompt):].tolist() != hf_greedy(name, tuple(prompt)))
    assert any(differs), f"{name}'s greedy tokens do not depend on {change}: the tests above would be weak"


def test_the_gpt_oss_reference_depends_on_its_sinks():
    model = build("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: as if there were none
    prompt = prompts()[2]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, len(prompt):].tolist() != hf_greedy("gpt_oss", tuple(prompt))
