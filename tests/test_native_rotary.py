"""The native rotary embedding (``engine/models/native_rotary.py``): transformers' Llama rotary bit
for bit, on decode rows, prefill rows (threaded) and GQA heads; transformers' own code for what the
native call does not take; and only Llama's rotary code is routed to it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaAttention, GemmaConfig
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding

from vmemkv.engine.models.native_rotary import (NativeRotary, is_llama_rotary, kernel_funcs, plain_function,
                                                swap_rotaries, unavailable)

from test_native_norm import on_threads

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")

LLAMA_ROTARY = plain_function(modeling_llama.apply_rotary_pos_emb)


def rotary_inputs(tokens: int, q_heads: int = 9, k_heads: int = 3, dim: int = 64, seed: int = 0):
    """q, k as the attention makes them (the projections' [1, tokens, heads, dim] seen as
    [1, heads, tokens, dim]) and Llama's cos, sin at random positions."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, q_heads * dim, generator=generator).view(1, tokens, q_heads, dim).transpose(1, 2)
    k = torch.randn(1, tokens, k_heads * dim, generator=generator).view(1, tokens, k_heads, dim).transpose(1, 2)
    config = LlamaConfig(hidden_size=q_heads * dim, num_attention_heads=q_heads, num_key_value_heads=k_heads,
                         head_dim=dim)
    positions = torch.randint(0, 8192, (1, tokens), generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    return q, k, cos, sin


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens,q_heads,k_heads,dim", [(1, 9, 3, 64), (16, 9, 3, 64), (2048, 9, 3, 64),
                                                         (5, 4, 4, 6)], ids=["one", "decode", "prefill", "odd"])
def test_native_rotary_equals_transformers_bit_for_bit(tokens, q_heads, k_heads, dim, threads):
    q, k, cos, sin = rotary_inputs(tokens, q_heads, k_heads, dim)
    got, want = on_threads(threads, lambda: (NativeRotary(LLAMA_ROTARY)(q, k, cos, sin),
                                             LLAMA_ROTARY(q, k, cos, sin)))
    for native, reference in zip(got, want):
        assert native.shape == reference.shape and torch.equal(native, reference)
    assert torch.equal(q, rotary_inputs(tokens, q_heads, k_heads, dim)[0])  # its inputs left as they were


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [1, 16, 2048], ids=["one", "decode", "prefill"])
def test_native_rotary_in_bfloat16_equals_transformers_bit_for_bit(tokens, threads):
    """bfloat16 rows and tables (as the model's rotary embedding gives them in bfloat16): each
    product rounded to bfloat16, then their sum, as the tensor ops round."""
    q, k, cos, sin = (t.bfloat16() for t in rotary_inputs(tokens))
    got, want = on_threads(threads, lambda: (NativeRotary(LLAMA_ROTARY)(q, k, cos, sin),
                                             LLAMA_ROTARY(q, k, cos, sin)))
    for native, reference in zip(got, want):
        assert native.dtype == torch.bfloat16 and torch.equal(native, reference)


def test_what_the_native_call_does_not_take_runs_transformers_code():
    calls = []

    def reference(*args):
        calls.append(args)
        return LLAMA_ROTARY(*args)

    native = NativeRotary(reference)
    q, k, cos, sin = rotary_inputs(4)
    cases = [(q.double(), k.double(), cos.double(), sin.double(), 1),  # neither float32 nor bfloat16
             (q.bfloat16(), k.bfloat16(), cos, sin, 1),  # tables of another dtype
             (q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2], 1),  # strided head rows
             (torch.cat([q, q]), torch.cat([k, k]), torch.cat([cos, cos]), torch.cat([sin, sin]), 1),  # batch 2
             (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)]  # [1, tokens, heads, dim]
    for case in cases:
        got, want = native(*case), LLAMA_ROTARY(*case)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(calls) == len(cases)


def native_count(model: torch.nn.Module) -> int:
    return sum(isinstance(f, NativeRotary) for m in model.modules() for f in kernel_funcs(m).values())


def test_only_llamas_rotary_behind_the_per_instance_hook_is_swapped():
    assert is_llama_rotary(modeling_llama.apply_rotary_pos_emb) and is_llama_rotary(LLAMA_ROTARY)
    assert not is_llama_rotary(torch.nn.Linear(2, 2)) and not is_llama_rotary(len)
    llama = LlamaAttention(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 0)
    gemma = GemmaAttention(GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16), 0)
    if not kernel_funcs(llama):
        pytest.skip("this transformers has no per-instance rotary hook (_kernel_funcs); the engine "
                    "keeps transformers' rotary")
    model = torch.nn.ModuleList([llama, gemma])
    # Gemma's file may carry a copy of Llama's rotary code
    gemma_llamas = sum(is_llama_rotary(f) for f in kernel_funcs(gemma).values())
    assert swap_rotaries(model) == 1 + gemma_llamas == native_count(model)
    assert swap_rotaries(model) == 0  # already swapped: a NativeRotary is not Llama's code


def test_the_engine_runs_the_native_rotary_on_a_model_it_loads_and_matches_hf():
    from test_engine_correctness import assert_clean, assert_matches_hf, make_engine, prompts, run

    batch = prompts(4)
    engine = make_engine("tiny-llama")
    model = engine.runner.model_runner.model
    hooked = sum(bool(kernel_funcs(m)) for m in model.modules())
    assert engine.native_rotaries == native_count(model) == hooked
    assert hooked in (0, model.config.num_hidden_layers)  # 0: no per-instance hook in this transformers
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)
    engine.close()
