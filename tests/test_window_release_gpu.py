"""Blocks released behind a sliding window on a GPU: FlashAttention-2 (which may load a tile before
the window start: the slot's released pages point at the zeroed hole page, a block table's at the
request's first held block) and the Triton decode kernel give exactly the tokens they give when
every block is kept. Everything here skips without CUDA; ``gpu_check.sh`` runs it (``-m gpu``).

A random-weight Mistral of 8 layers x 8 KV heads x 32 dims in float16: 8 KiB a token, so a 2 MiB
page holds 256 tokens (what FlashAttention-2's block tables need); window 200, 40 + 520 tokens,
so one block is released per request (about 600 decode steps a run, six runs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WINDOW = 200
NEW_TOKENS = 520


def mistral():
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                           max_position_embeddings=2048, bos_token_id=256, eos_token_id=None,
                           pad_token_id=0, sliding_window=WINDOW)
    return AutoModelForCausalLM.from_config(config).to("cuda", torch.float16).eval()


def generate(kv_backend: str, attention: str, release: bool) -> tuple[list[list[int]], int]:
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.engine.models.zoo import byte_tokenizer

    class Config(EngineConfig):
        def cache_config(self, model):  # keeping every block: the manager without the window
            cache = super().cache_config(model)
            return cache if release else dataclasses.replace(cache, sliding_window=None)

    config = Config(device="cuda", dtype="float16", max_num_seqs=4, max_model_len=1024,
                    max_num_batched_tokens=128, kv_backend=kv_backend, attention=attention)
    engine = LLMEngine(config, model=mistral(), tokenizer=byte_tokenizer())
    try:
        if attention == "flash" and not engine.attention_kernel.startswith("flash-"):
            pytest.skip(f"no FlashAttention-2 kernel here: {engine.attention_kernel}")
        assert engine.manager.tokens_per_page == 256
        prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(40 + 3 * i)] for i in range(3)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
        engine.manager.check()
        assert engine.manager.num_blocks_in_use == 0
        released = engine.manager.cache_stats().blocks_released_behind_window
        return [final[str(i)].outputs[0].token_ids for i in range(len(prompts))], released
    finally:
        engine.close()


@pytest.mark.parametrize("kv_backend,attention", [("vmem", "flash"), ("paged", "flash"),
                                                  ("vmem", "triton")])
def test_release_gives_the_tokens_of_keeping_every_block(kv_backend, attention):
    kept, none_released = generate(kv_backend, attention, release=False)
    tokens, released = generate(kv_backend, attention, release=True)
    assert none_released == 0 and released >= 3
    assert tokens == kept
