"""Recurrent state groups on the device's pages: a manager with an attention group and a state
group keeps each request's state (written through ``state_views``) bit-exact through a fork and a
swap out and in, and the recurrent hybrids' engine gives Hugging Face ``generate``'s greedy tokens.

Every test runs on CPU pages (the logic, in the ordinary suite) and on CUDA VMM pages (marked
``gpu``, skipping without CUDA; ``experiments/gpu_check.sh`` runs them in its engine_gpu step).
On CUDA the state of a slot spans two 2 MiB pages, so its contiguity across pages is checked too.

Expected time on an H200: a few seconds for the CUDA cases (a few pages mapped and copied, two
engine runs of 4 prompts x 16 tokens of a 2- or 4-layer tiny model, and their ``generate``
references).
"""

from __future__ import annotations

import pytest
import torch

from vmemkv import CacheConfig, KVCacheManager, RecurrentStateSpec, StatePart

from conftest import cuda_bindings_missing
from test_state_engine import STATE_MIXERS_ROUTED

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(cuda_bindings_missing(), reason="needs cuda-python (pip install cuda-bindings)"),
])]

# Qwen3-Next-like: a convolution window in the model's dtype, a delta-rule state in float32;
# two state layers of 1.03 MiB: a slot's state spans two 2 MiB CUDA pages.
SPEC = RecurrentStateSpec((StatePart("conv", (256, 4), torch.bfloat16),
                           StatePart("recurrent", (16, 128, 128), torch.float32)))
STATE_LAYERS, ATTENTION_LAYERS = (0, 2), (1, 3)


def random_state(seed: int, device: str) -> dict[int, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {layer: [torch.randn(part.shape, generator=generator).to(device, part.dtype) for part in SPEC.parts]
            for layer in STATE_LAYERS}


def write_state(manager, request_id, state) -> None:
    slot = manager.slot_of(request_id)
    for layer, parts in state.items():
        for view, value in zip(manager.state_views(layer), parts):
            view[slot].copy_(value)


def assert_state(manager, request_id, state) -> None:
    slot = manager.slot_of(request_id)
    for layer, parts in state.items():
        for view, value in zip(manager.state_views(layer), parts):
            assert torch.equal(view[slot], value), f"{request_id}: layer {layer}'s state changed"


@pytest.mark.parametrize("device", DEVICES)
def test_state_and_kv_survive_fork_and_swap_bit_exact(device):
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=32, max_num_seqs=2,
                         max_model_len=512, dtype=torch.bfloat16, device=device,
                         swap_space_bytes=64 << 20)
    with KVCacheManager(config, layer_windows=[SPEC if i in STATE_LAYERS else None for i in range(4)]) as manager:
        attention, state_group = manager.groups
        assert attention.layers == ATTENTION_LAYERS and state_group.layers == STATE_LAYERS
        if device == "cuda":
            assert state_group.state_blocks == 2  # 2.06 MiB of state a slot
        assert manager.admit("a", list(range(1, 41))) == 0
        a_state, b_state, c_state = (random_state(seed, device) for seed in (1, 2, 3))
        rows = torch.randn(40, 2, 64, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
        write_state(manager, "a", a_state)
        manager.kv_views(1)[0][manager.slot_of("a"), :40] = rows
        manager.commit("a")

        assert manager.fork("a", "b")
        assert_state(manager, "b", a_state)  # copied
        write_state(manager, "b", b_state)
        assert_state(manager, "a", a_state)  # a copy, not shared

        assert manager.preempt("b", "swap") == "swap"
        assert manager.admit("c", list(range(7, 20))) == 0  # b's slot, and its state pages
        assert_state(manager, "c", {layer: [torch.zeros_like(p) for p in parts]
                                    for layer, parts in c_state.items()})  # zeroed, not b's
        write_state(manager, "c", c_state)
        manager.free("c")
        assert manager.swap_in("b")
        manager.check()
        for request_id, state in (("a", a_state), ("b", b_state)):
            assert_state(manager, request_id, state)
            assert torch.equal(manager.kv_views(1)[0][manager.slot_of(request_id), :40], rows)
        manager.free("a")
        manager.free("b")
        manager.check()
        assert manager.num_blocks_in_use == 0 and state_group.num_blocks_in_use == 0


@STATE_MIXERS_ROUTED
@pytest.mark.parametrize("model", ["tiny-lfm2", "tiny-qwen3-next"])
@pytest.mark.parametrize("device", DEVICES)
def test_state_engine_matches_hf_generate(model, device):
    """Ragged prompts with chunked prefill (each chunk continues from the slot's state) and
    ``n = 2`` (the state forked), against ``generate`` on the same device."""
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.engine.models.zoo import load_model

    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 33, 48))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, n=2)
    engine = LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=8, max_model_len=256,
                                    max_num_batched_tokens=16))
    try:
        final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
        reference, _ = load_model(model, device=device)
        reference.set_attn_implementation("sdpa")
        for i, prompt in enumerate(prompts):
            expected = reference.generate(torch.tensor([prompt], device=device), max_new_tokens=16,
                                          min_new_tokens=16, do_sample=False, pad_token_id=0)
            for completion in final[str(i)].outputs:
                assert completion.token_ids == expected[0, len(prompt):].tolist(), f"prompt {i} diverged"
        assert engine.manager.cache_stats().forks == len(prompts)
        engine.manager.check()
        assert engine.manager.num_blocks_in_use == 0
    finally:
        engine.close()
