"""The native RMS norm (``engine/models/native_norm.py``): Llama's RMSNorm module's results up to
float rounding, on decode rows, prefill rows (threaded) and odd sizes; the module's own tensor ops
for what the native call does not take; and only Llama's norm code is swapped. In bfloat16 the
engine's greedy tokens are the same with and without the native norm and rotary (bfloat16 rounds
the engine's attention and linear layers unlike HF's own bfloat16 forward, so HF ``generate`` is
no reference there: the same engine without the two native calls is)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from vmemkv.engine.models.native_norm import NativeRMSNorm, is_llama_rms_norm, swap_rms_norms, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "built")


def llama_norm(size: int, eps: float = 1e-5, seed: int = 0) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(size, eps=eps)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm


def on_threads(threads: int, call):
    """``call()`` with torch at ``threads`` intra-op threads (the native call takes torch's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 576), (1, 2048, 576), (3, 5, 7), (2, 1000)],
                         ids=["decode", "prefill", "odd", "2d"])
def test_native_norm_matches_llamas_module(shape, threads):
    norm = llama_norm(shape[-1], eps=1e-6)
    native = NativeRMSNorm(norm)
    x = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got, want = on_threads(threads, lambda: (native(x), norm(x)))
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 576), (1, 2048, 576), (3, 5, 7)], ids=["decode", "prefill", "odd"])
def test_native_norm_in_bfloat16_matches_llamas_module(shape, threads):
    """Rounded where the module's tensor ops round: almost always equal, at most two bfloat16 steps
    apart (the sum of squares in another order may move the scale by a float ulp, which can round
    the normed value one step the other way, and its product with the weight once more)."""
    norm = llama_norm(shape[-1], eps=1e-6).to(torch.bfloat16)
    native = NativeRMSNorm(norm)
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).bfloat16()
    got, want = on_threads(threads, lambda: (native(x), norm(x)))
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max() <= 2 and (steps == 0).float().mean() > 0.99


def test_what_the_native_call_does_not_take_runs_the_modules_ops():
    norm = llama_norm(64)
    native = NativeRMSNorm(norm)
    strided = torch.randn(4, 128)[:, ::2]  # not contiguous
    assert torch.equal(native(strided), norm(strided))
    half = torch.randn(3, 64, dtype=torch.bfloat16)  # not the weight's dtype
    assert torch.equal(native(half), norm(half))


def test_only_llamas_norm_code_on_a_float32_or_bfloat16_weight_is_swapped():
    assert is_llama_rms_norm(LlamaRMSNorm(8)) and is_llama_rms_norm(Qwen2RMSNorm(8))  # a modular copy
    assert not is_llama_rms_norm(GemmaRMSNorm(8))  # scales by 1 + weight
    assert is_llama_rms_norm(LlamaRMSNorm(8).to(torch.bfloat16))
    assert not is_llama_rms_norm(LlamaRMSNorm(8).to(torch.float16))
    model = nn.ModuleDict({"a": LlamaRMSNorm(8), "b": nn.Sequential(GemmaRMSNorm(8), Qwen2RMSNorm(8))})
    assert swap_rms_norms(model) == 2
    assert [type(m).__name__ for m in (model["a"], *model["b"])] == ["NativeRMSNorm", "GemmaRMSNorm",
                                                                      "NativeRMSNorm"]


def test_the_engine_runs_native_norms_on_a_model_it_loads_and_matches_hf():
    from test_engine_correctness import assert_clean, assert_matches_hf, make_engine, prompts, run

    batch = prompts(4)
    engine = make_engine("tiny-llama")
    model = engine.runner.model_runner.model
    assert engine.native_norms == 2 * model.config.num_hidden_layers + 1  # two a layer and the last
    assert sum(isinstance(m, NativeRMSNorm) for m in model.modules()) == engine.native_norms
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)
    engine.close()


def test_the_engine_in_bfloat16_gives_the_same_greedy_tokens_with_and_without_the_native_ops():
    from test_engine_correctness import assert_clean, make_engine, prompts, run

    from vmemkv import _rms_norm, _rotary
    from vmemkv.engine.core import llm_engine

    batch = prompts(8)

    def greedy_tokens(native: bool) -> tuple[list, dict, int]:
        calls = {"rms_norm": 0, "rotary": 0}

        def counted(extension, name):
            function = getattr(extension, name)

            def call(*args):
                calls[name] += 1
                return function(*args)
            return mock.patch.object(extension, name, call)

        patches = [counted(_rms_norm, "rms_norm"), counted(_rotary, "rotary")]
        if not native:  # the model's own modules and rotary, the rest as the engine builds it
            patches += [mock.patch.object(llm_engine, "swap_rms_norms", lambda model: 0),
                        mock.patch.object(llm_engine, "swap_rotaries", lambda model: 0)]
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            engine = make_engine("tiny-llama", dtype="bfloat16")
            assert next(engine.runner.model_runner.model.parameters()).dtype == torch.bfloat16
            tokens = [output.outputs[0].token_ids for output in run(engine, batch)]
            rotaries = engine.native_rotaries
            assert_clean(engine)
            engine.close()
        return tokens, calls, rotaries

    native, calls, rotaries = greedy_tokens(True)
    # the native calls ran, not the fallbacks (the rotary's where transformers has its per-instance
    # hook: not in 5.17, the GPU image's; test_native_rotary covers that case)
    assert calls["rms_norm"] > 0 and (calls["rotary"] > 0) == (rotaries > 0)
    own, calls, _ = greedy_tokens(False)
    assert calls == {"rms_norm": 0, "rotary": 0}
    assert native == own
