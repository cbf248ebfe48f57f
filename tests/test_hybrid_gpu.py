"""A hybrid model (Gemma-2: local and global layers in two layout groups) through the engine on a
GPU: two CUDA VMM backends, the hole page behind the local group's window, released (-1) entries
in the local group's block tables, the lookahead worker mapping in both groups during the forward,
swap preemption through both groups' pinned host stores, and FlashAttention-2 with a window over
each group. Everything here skips without CUDA; ``gpu_check.sh`` runs it (``-m gpu``).

Tiny random-weight Gemma-2s, shaped so that 2 MiB pages hold few tokens:

* ``wide``: 4 layers (2 local of window 32, 2 global), 32 KV heads x 128 dims, float32: 64 KiB a
  token per group, so a page holds 32 tokens and a sequence past 64 tokens has a local page wholly
  behind the window (released: the slot's page points at the hole page, the block table says -1).
  Soft-capping on (50), as Gemma-2 has. SDPA and the Triton decode kernel, each on slots and on
  block tables, give Hugging Face ``generate``'s greedy tokens (eager attention, the same GPU).
* ``flash``: 4 layers, 8 KV heads x 128 dims, float16, no soft-capping (PyTorch's bundled
  FlashAttention-2 has none, and a soft-capped layer would take the SDPA path): 256 tokens a page,
  as FlashAttention-2's block tables need (``tokens_per_page=256`` for the one group that keeps
  every block, whose pages would hold 128). Its tokens equal the same engine keeping every block in
  one group (the kernel's own arithmetic both times; float16 against ``generate``'s eager
  attention would differ by rounding, not by a bug).

Expected time on an H200: about 10-20 s for the file (inside gpu_check.sh's gpu_marked_tests
step): nine short engine runs (3 requests, 24-40 new tokens, about 40-50 steps of a 4-layer
model each), one set of ``generate`` references, and the Triton decode kernel's first compilations.
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import cuda_bindings_missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(cuda_bindings_missing(), reason="needs cuda-python (pip install cuda-bindings)"),
]

DEVICE = "cuda"
WINDOW = 32
NEW_TOKENS = 40
SHAPES = {
    "wide": dict(num_attention_heads=32, num_key_value_heads=32, head_dim=128, query_pre_attn_scalar=128,
                 attn_logit_softcapping=50.0, dtype=torch.float32, tokens_per_page=32),
    "flash": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=128, query_pre_attn_scalar=128,
                  attn_logit_softcapping=None, dtype=torch.float16, tokens_per_page=256),
}


def gemma2(shape: str) -> torch.nn.Module:
    """A fresh model (its own config object: the engine changes its model's attention), seed 0."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    options = dict(SHAPES[shape])
    dtype = options.pop("dtype")
    options.pop("tokens_per_page")
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          max_position_embeddings=1024, sliding_window=WINDOW, initializer_range=0.1,
                          tie_word_embeddings=False, bos_token_id=256, eos_token_id=None, pad_token_id=0,
                          **options)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE, dtype).eval()
    model.set_attn_implementation("eager")  # soft-capping: the reference computes it exactly
    return model


def prompts(lengths) -> list[list[int]]:
    return [[(31 * i + 7 * j) % 250 + 1 for j in range(length)] for i, length in enumerate(lengths)]


@functools.cache
def hf_tokens(shape: str, prompt: tuple[int, ...], new_tokens: int) -> tuple[int, ...]:
    model = gemma2(shape)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def run(shape: str, batch: list[list[int]], new_tokens: int = NEW_TOKENS, **overrides):
    """(each prompt's tokens, the engine's stats, its attention label, whether it was hybrid: the
    global layers in layer group 0 and the local ones, window ``WINDOW``, in group 1)."""
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.engine.models.zoo import byte_tokenizer
    from vmemkv.cache.attention_spec import SLIDING, AttentionSpec

    options = dict(device=DEVICE, dtype=str(SHAPES[shape]["dtype"]).removeprefix("torch."), max_num_seqs=4,
                   max_model_len=256, max_num_batched_tokens=64, swap_space_bytes=64 << 20)
    engine = LLMEngine(EngineConfig(**{**options, **overrides}), model=gemma2(shape),
                       tokenizer=byte_tokenizer())
    try:
        manager = engine.manager
        groups = manager.layout_groups
        hybrid = len(groups) == 2
        if hybrid:
            assert groups[0].layers == (1, 3) and not groups[0].spec.releases
            assert groups[1].layers == (0, 2) and groups[1].spec == AttentionSpec(SLIDING, WINDOW)
        else:
            assert len(groups) == 1
        assert manager.tokens_per_page == SHAPES[shape]["tokens_per_page"]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(batch)])
        manager.check()
        assert manager.num_blocks_in_use == 0
        assert all(group.num_blocks_in_use == 0 for group in groups)
        tokens = [final[str(i)].outputs[0].token_ids for i in range(len(batch))]
        return tokens, engine.stats(), engine.attention_kernel, hybrid
    finally:
        engine.close()


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_hybrid_engine_on_cuda_releases_local_blocks_and_matches_hf(kv_backend, attention):
    if attention == "triton":
        pytest.importorskip("triton", reason="the Triton decode kernel needs triton")
    batch = prompts((30, 25, 47))  # 65-87 tokens: each has a page of 32 wholly behind the window
    tokens, stats, label, hybrid = run("wide", batch, kv_backend=kv_backend, attention=attention)
    assert hybrid and label == attention
    for prompt, got in zip(batch, tokens):
        assert tuple(got) == hf_tokens("wide", tuple(prompt), NEW_TOKENS), f"prompt of {len(prompt)} diverged"
    assert stats["blocks_released_behind_window"] >= len(batch)
    if kv_backend == "vmem":  # decodes crossing a page got it mapped by the worker, both groups
        assert stats["map_background_seconds"] > 0


def test_hybrid_engine_on_cuda_swaps_both_groups_and_matches_hf():
    # 6 global blocks of 32 tokens for 3 sequences growing to 2-3 blocks each: someone is swapped
    batch = prompts((30, 20, 41))
    tokens, stats, _, hybrid = run("wide", batch, kv_backend="vmem", attention="sdpa", num_blocks=6,
                                   preemption_mode="swap", enable_prefix_caching=False, watermark=0.0)
    assert hybrid and stats["preemptions_swap"] > 0 and stats["swap_in_bytes"] > 0
    for prompt, got in zip(batch, tokens):
        assert tuple(got) == hf_tokens("wide", tuple(prompt), NEW_TOKENS), f"prompt of {len(prompt)} diverged"


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_hybrid_engine_on_cuda_with_flash_matches_one_group_keeping_every_block(kv_backend, monkeypatch):
    from vmemkv.attention import flash

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FlashAttention-2 needs sm80+")
    calls = []
    varlen = flash._VarlenCall._varlen

    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return varlen(self, *args, **kwargs)

    monkeypatch.setattr(flash._VarlenCall, "_varlen", counted)
    batch = prompts((70, 9, 45))  # past the window of 32: the local layers' window matters
    try:
        tokens, _, label, hybrid = run("flash", batch, 24, kv_backend=kv_backend, attention="flash",
                                       tokens_per_page=256)
    except Exception as error:  # a ConfigError saying why flash cannot run here (no kernel, a probe)
        if "attention='flash' cannot run here" in str(error):
            pytest.skip(str(error))
        raise
    assert hybrid and label.startswith("flash-") and calls  # the kernel ran, not an SDPA fallback
    calls.clear()
    kept, _, _, one_group = run("flash", batch, 24, kv_backend=kv_backend, attention="flash",
                                tokens_per_page=256, release_behind_window=False)
    assert not one_group and calls
    assert tokens == kept
