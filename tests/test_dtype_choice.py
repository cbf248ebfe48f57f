"""``dtype="auto"`` (vLLM's default): the checkpoint's dtype where the device computes it
natively, else float32, the choice said once at start-up; ``dtype="float32"`` gives Hugging Face's
float32 tokens exactly."""

from __future__ import annotations

import pytest
import torch

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.models import dtype_choice
from vmemkv.engine.models.dtype_choice import auto_dtype, checkpoint_dtype, cpu_computes
from vmemkv.engine.models.zoo import load_model, recorded_dtype
from vmemkv.errors import ConfigError

from vmemkv.engine.core.llm_engine import run_to_completion

SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX2_ONLY = frozenset({"avx", "avx2", "fma"})


@pytest.mark.parametrize("recorded,device,flags,expected", [
    (torch.bfloat16, "cpu", SAPPHIRE_RAPIDS, torch.bfloat16),
    (torch.bfloat16, "cpu", frozenset({"avx512_bf16"}), torch.bfloat16),
    (torch.bfloat16, "cpu", frozenset({"amx_bf16"}), torch.bfloat16),
    (torch.bfloat16, "cpu", AVX2_ONLY, torch.float32),  # would widen every product
    (torch.float16, "cpu", SAPPHIRE_RAPIDS, torch.float32),  # no AVX-512 FP16 / AMX-FP16
    (torch.float16, "cpu", frozenset({"amx_fp16"}), torch.float16),
    (torch.float32, "cpu", SAPPHIRE_RAPIDS, torch.float32),
    (None, "cpu", SAPPHIRE_RAPIDS, torch.float32),  # not recorded: float32, as transformers loads it
    (torch.bfloat16, "cuda", AVX2_ONLY, torch.bfloat16),
    (torch.float16, "cuda:1", AVX2_ONLY, torch.float16),
    (torch.float32, "cuda", AVX2_ONLY, torch.bfloat16),
])
def test_auto_takes_the_checkpoints_dtype_where_the_device_computes_it(recorded, device, flags, expected):
    dtype, why = auto_dtype(recorded, device, flags)
    assert dtype == expected
    if device == "cpu" and recorded == torch.bfloat16 and flags == AVX2_ONLY:
        assert "no avx512_bf16 or amx_bf16" in why and "--dtype bfloat16" in why


def test_the_recorded_dtype_is_read_from_the_config_or_the_published_checkpoint():
    class Config:
        dtype = "bfloat16"

    class Older:
        torch_dtype = torch.float16

    assert checkpoint_dtype(Config()) == torch.bfloat16 and checkpoint_dtype(Older()) == torch.float16
    assert checkpoint_dtype(object()) is None
    assert recorded_dtype("tiny-llama") is None  # the built-ins record none: float32
    # the converted copy's weights are float32; the published SmolLM2 checkpoint is bfloat16
    assert recorded_dtype("smollm2-135m-instruct") == torch.bfloat16
    assert cpu_computes(torch.float32, AVX2_ONLY) and not cpu_computes(torch.bfloat16, AVX2_ONLY)


def test_auto_is_the_default_and_resolved_only_with_the_model():
    config = EngineConfig()
    assert config.dtype == "auto"
    with pytest.raises(ConfigError, match="resolved when the model is known"):
        config.torch_dtype
    with pytest.raises(ConfigError, match="unknown dtype 'float64x'.*auto"):
        EngineConfig(dtype="float64x")
    asked, why = EngineConfig(dtype="float32").with_dtype_for(torch.bfloat16)
    assert asked.torch_dtype == torch.float32 and why == "float32 (as asked)"


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """tiny-llama saved as a checkpoint that records bfloat16, as published models do."""
    model, tokenizer = load_model("tiny-llama", dtype=torch.bfloat16)
    directory = tmp_path_factory.mktemp("bf16-checkpoint")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
    return [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def hf_greedy(directory: str, dtype: torch.dtype, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 17, 33, 2], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]]


@pytest.mark.parametrize("flags,expected", [(SAPPHIRE_RAPIDS, torch.bfloat16), (AVX2_ONLY, torch.float32)])
def test_an_engine_runs_a_bf16_checkpoint_in_bf16_only_where_the_cpu_computes_it(
        bf16_checkpoint, monkeypatch, flags, expected):
    """On an AVX2-only CPU ``auto`` falls back to float32 with a note; where it runs float32 the
    tokens equal Hugging Face's float32 generate of the same checkpoint."""
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    engine = LLMEngine(EngineConfig(model=bf16_checkpoint, max_num_seqs=2, max_model_len=64))
    try:
        assert engine.config.dtype == str(expected).removeprefix("torch.")
        assert engine.manager.config.dtype == expected  # the KV cache too
        assert engine.dtype_choice.startswith("auto: ")
        if expected == torch.float32:
            assert "this CPU has no avx512_bf16" in engine.dtype_choice
            assert greedy_tokens(engine, PROMPTS) == [hf_greedy(bf16_checkpoint, torch.float32, p)
                                                      for p in PROMPTS]
        else:
            assert "computes natively" in engine.dtype_choice
            assert len(greedy_tokens(engine, PROMPTS)[0]) == 8
    finally:
        engine.close()


def test_float32_asked_runs_float32_whatever_the_checkpoint(bf16_checkpoint):
    engine = LLMEngine(EngineConfig(model=bf16_checkpoint, dtype="float32", max_num_seqs=2, max_model_len=64))
    try:
        assert engine.dtype_choice == "float32 (as asked)"
        assert greedy_tokens(engine, PROMPTS) == [hf_greedy(bf16_checkpoint, torch.float32, p) for p in PROMPTS]
    finally:
        engine.close()


def test_bfloat16_on_the_avx2_kernels_is_still_correct(bf16_checkpoint):
    """A CPU without AVX-512 runs a forced bfloat16 on the 8-float (AVX2) decode path: its tokens
    equal the AVX-512 path's (both widen the bf16 rows to float32 in the same order of sums)."""
    from vmemkv import _decode_attention

    engine = LLMEngine(EngineConfig(model=bf16_checkpoint, dtype="bfloat16", max_num_seqs=2, max_model_len=64))
    try:
        wide = greedy_tokens(engine, PROMPTS)
        before = _decode_attention.grouped_heads(False)
        try:
            narrow = greedy_tokens(engine, PROMPTS)
        finally:
            _decode_attention.grouped_heads(before)
        assert narrow == wide
        # and bfloat16 stays close to Hugging Face's bfloat16 (rounding may part them late)
        hf = [hf_greedy(bf16_checkpoint, torch.bfloat16, p) for p in PROMPTS]
        assert all(a[:2] == b[:2] for a, b in zip(narrow, hf))
    finally:
        engine.close()


def test_the_cli_says_the_choice_once(capsys, monkeypatch):
    from vmemkv.cli import main

    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("vmemkv: dtype auto: the checkpoint's float32") == 1
