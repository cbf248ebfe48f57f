"""The engine on models mixing local and global layers (tiny Gemma-2 / Gemma-3 / GPT-OSS) runs a
``KVCacheManager`` of two layer groups (global, then sliding-window layers) on both KV backends and gives Hugging Face's greedy tokens: over a long
generation with chunked prefill (the local group's blocks behind the window go back to the pool it
shares with the global group),
with prefix hits, and under preemption by swap and by recompute. On block tables each group's
layers read through that group's own table (``addressing.GroupedBlockTableAddressing``)."""

from __future__ import annotations

import functools

import pytest
import torch

from vmemkv.attention.paged import BlockTableAttention
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.addressing import GroupedBlockTableAddressing
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.models.zoo import byte_tokenizer, load_model
from vmemkv import KVCacheManager
from vmemkv.cache.attention_spec import SLIDING
from vmemkv.cache.request import RELEASED

from test_sliding_window_models import build, prompts, reference

LONG = 40  # new tokens: far past the window of 3
WRITE = BlockTableAttention.write
BACKENDS = ["vmem", "paged"]


def held(table) -> int:
    return sum(block != RELEASED for block in table)


def hybrid_engine(name: str, monkeypatch, **overrides) -> LLMEngine:
    options = dict(max_num_seqs=4, max_model_len=96, tokens_per_page=4, max_num_batched_tokens=8,
                   swap_space_bytes=1 << 20)
    engine = LLMEngine(EngineConfig(**{**options, **overrides}), model=build(name), tokenizer=byte_tokenizer())
    assert is_layered(engine.manager)
    if engine.config.kv_backend == "paged":
        assert isinstance(engine.addressing, GroupedBlockTableAddressing)
        writes_only_held_blocks(monkeypatch, engine.manager)
    return engine


def is_layered(manager: KVCacheManager) -> bool:
    """Whether the manager keeps the model's global and sliding-window layers in two layer groups
    (the old ``HybridKVCacheManager``)."""
    groups = manager.layout_groups
    return (len(groups) == 2 and not groups[0].spec.releases and groups[1].spec.kind == SLIDING
            and groups[1].window is not None)


def writes_only_held_blocks(monkeypatch, manager: KVCacheManager) -> None:
    """On block tables, check every K/V write of every layer: it lands in a block its layer's
    group holds privately (reference count 1), never in a free block or another group's id."""
    write = WRITE  # not a write patched for an earlier engine of the same test

    def checked(self, layer, key, value):
        group = manager.layer_group(layer)
        for block in self.write_blocks.tolist():
            assert group.pool.ref[block] == 1, f"layer {layer} writes block {block}, not held privately"
        write(self, layer, key, value)

    monkeypatch.setattr(BlockTableAttention, "write", checked)


def hf_tokens(name: str, prompt: list[int], new_tokens: int = LONG) -> list[int]:
    out = reference(name).generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def generate(engine: LLMEngine, batch: list[list[int]], first: int = 0) -> dict:
    """Each prompt's final output, by request id (``first``, ``first + 1``, ...)."""
    return generate_n(engine, batch, LONG, first)


def generate_n(engine: LLMEngine, batch: list[list[int]], new_tokens: int, first: int = 0) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return run_to_completion(engine, [(str(first + i), p, params) for i, p in enumerate(batch)])


def close_clean(engine: LLMEngine) -> None:
    manager = engine.manager
    manager.check()
    assert manager.num_blocks_in_use == 0
    assert all(group.num_blocks_in_use == 0 for group in manager.layout_groups)
    engine.close()


@pytest.mark.parametrize("kv_backend", BACKENDS)
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss"])
def test_engine_releases_local_blocks_over_a_long_generation_and_matches_hf(name, kv_backend, monkeypatch):
    batch = prompts((20, 5, 11, 17))  # more global blocks than the local group has
    engine = hybrid_engine(name, monkeypatch, kv_backend=kv_backend)
    manager = engine.manager
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(batch):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, list[int]] = {}
    global_group, local_group = manager.layout_groups
    # one global and one local layer: blocks of the same bytes, drawn from one shared pool
    assert global_group.memory is local_group.memory and manager.memories == (global_group.memory,)
    bound = local_group.blocks_for_tokens(96, 8)  # the window plus one chunk
    peak_global = 0  # the most blocks the global group's requests held at once
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        blocks = [set(), set()]  # each group's blocks held by the running sequences
        for seq in engine.scheduler.running:
            assert held(seq.kv.group_block_table(1)) <= bound
            for group in (0, 1):
                blocks[group] |= set(seq.kv.group_block_table(group)) - {RELEASED}
        assert not blocks[0] & blocks[1]  # a block of the shared pool holds one group's layer
        assert manager.num_blocks_in_use == len(blocks[0]) + len(blocks[1])  # the pool counts both
        peak_global = max(peak_global, len(blocks[0]))
        manager.check()
    for index, prompt in enumerate(batch):
        assert tokens[str(index)] == hf_tokens(name, prompt), f"{name}: prompt {index} diverged"
    stats = engine.stats()
    assert stats["blocks_released_behind_window"] > 0
    # the peak counts both groups: more than the global group's blocks alone (the shared pool's
    # blocks in use are both groups', so its peak is the bytes' peak)
    assert stats["peak_kv_bytes"] > peak_global * manager.block_bytes
    assert stats["peak_kv_bytes"] == engine.peak_blocks_in_use * manager.block_bytes
    close_clean(engine)


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_engine_prefix_hits_match_hf(kv_backend, monkeypatch):
    # 33 tokens: two whole pages of 16 tokens (each group's pages hold 16 tokens of one layer)
    system = prompts((33,), offset=5)[0]
    batch = [system + tail for tail in prompts((2, 5, 3))]
    engine = hybrid_engine("gemma2", monkeypatch, kv_backend=kv_backend)
    first = generate(engine, batch[:1])
    rest = generate(engine, batch[1:], first=1)
    assert first["0"].num_cached_tokens == 0
    assert all(rest[str(i)].num_cached_tokens == 32 for i in range(1, len(batch)))
    for index, prompt in enumerate(batch):
        output = (first if index == 0 else rest)[str(index)]
        assert output.outputs[0].token_ids == hf_tokens("gemma2", prompt), f"prompt {index} diverged"
    close_clean(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_engine_preemption_matches_hf(kv_backend, mode, monkeypatch):
    # one shared pool of 14 one-layer blocks of 16 tokens for 4 sequences that each grow to 3-4
    # global blocks and hold up to 2 local ones (24 at once): someone waits
    batch = prompts((20, 14, 9, 13))
    engine = hybrid_engine("gemma2", monkeypatch, kv_backend=kv_backend, num_blocks=14, preemption_mode=mode,
                           enable_prefix_caching=False, watermark=0.0)
    groups = engine.manager.layout_groups
    assert groups[0].memory is groups[1].memory and engine.manager.num_blocks == 14
    need = sum(group.blocks_for_tokens(len(prompt) + LONG, 8) for prompt in batch for group in groups)
    assert need == 24 > engine.manager.num_blocks
    final = generate(engine, batch)
    assert engine.scheduler.num_preemptions > 0
    for index, prompt in enumerate(batch):
        assert final[str(index)].outputs[0].token_ids == hf_tokens("gemma2", prompt), f"prompt {index} diverged"
    assert engine.stats()["blocks_released_behind_window"] > 0
    close_clean(engine)


@functools.cache
def tiny_gemma2_reference(prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    model, _ = load_model("tiny-gemma2")  # its own instance: the engine's switches attention
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=[])  # no eos: the engine's ignore_eos
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_the_built_in_tiny_gemma2_matches_hf_releasing_or_keeping_every_block(kv_backend, release):
    """The A/B's hybrid model (two local layers of window 128, two global): generations well past
    the window give HF's tokens in two layout groups, and in one that keeps every block."""
    model, tokenizer = load_model("tiny-gemma2")
    engine = LLMEngine(EngineConfig(model="tiny-gemma2", max_num_seqs=3, max_model_len=256,
                                    kv_backend=kv_backend, release_behind_window=release),
                       model, tokenizer)
    assert is_layered(engine.manager) == release
    assert len(engine.manager.layout_groups) == (2 if release else 1)
    batch = prompts((30, 12, 21))
    final = generate_n(engine, batch, 160)
    for index, prompt in enumerate(batch):
        assert final[str(index)].outputs[0].token_ids == tiny_gemma2_reference(tuple(prompt), 160)
    assert (engine.stats()["blocks_released_behind_window"] > 0) == release
    close_clean(engine)
