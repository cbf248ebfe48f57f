"""FlashAttention over the slots of a hybrid model's two layer groups: each layer's slot views
are flattened with its own group's geometry. In the per-layer layout a slot's rows span its
group's layers, so a Gemma-3-like model with two local layers and one global layer has slots of
different rows in its two groups; one geometry for every layer (layer 0's) would make the global
layers read another slot's rows, or past the reservation (an illegal address on a GPU).

The engine runs on CPU with the FlashAttention classes over the float64-semantics reference
kernel (the GPU kernels' call signature), and gives Hugging Face's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from vmemkv.attention.choice import AttentionChoice
from vmemkv.attention.flash_args import flat_rows, slot_geometry
from vmemkv.attention.flash_kernels import FlashKernel
from vmemkv.attention.flash_reference import reference_varlen
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core import addressing
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.models.zoo import byte_tokenizer
from vmemkv.cache.attention_spec import SLIDING

from test_sliding_window_models import build, prompts

TWO_LOCAL_ONE_GLOBAL = dict(num_hidden_layers=3,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
KERNEL = FlashKernel("reference", reference_varlen, window=True, softcap=True)
NEW_TOKENS = 12


def flash_on_cpu(monkeypatch) -> None:
    """The engine's attention choice is FlashAttention over the reference kernel, with layer 0's
    geometry in the choice (what choose_attention reports)."""
    def choose(requested, device, kv_backend, dtype, q_heads, kv_heads, head_dim, tokens, kv_views,
               other_kv_views=()):
        rows = slot_geometry(*kv_views)
        return AttentionChoice("flash", KERNEL, rows, flat_rows(kv_views[0], rows))

    monkeypatch.setattr(addressing, "choose_attention", choose)


@pytest.mark.parametrize("layout", ["per_layer", "token_major"])
def test_flash_over_hybrid_slots_uses_each_groups_geometry_and_matches_hf(layout, monkeypatch):
    flash_on_cpu(monkeypatch)
    model = build("gemma3", **TWO_LOCAL_ONE_GLOBAL)
    engine = LLMEngine(EngineConfig(max_num_seqs=3, max_model_len=64, tokens_per_page=4,
                                    max_num_batched_tokens=8, swap_space_bytes=1 << 20, layout=layout),
                       model=model, tokenizer=byte_tokenizer())
    manager = engine.manager
    global_group, local_group = manager.layout_groups
    assert global_group.layers == (2,) and not global_group.spec.releases
    assert local_group.layers == (0, 1) and local_group.spec.kind == SLIDING
    assert engine.attention_kernel == "flash-reference"
    geometry = addressing.layer_geometries(manager)
    # per_layer: the local group's slots span two layers, the global group's one
    assert (len(set(geometry)) == 2) == (layout == "per_layer")
    for layer, (rows, _) in enumerate(geometry):
        assert rows == slot_geometry(*manager.kv_views(layer))
    batch = prompts((13, 5, 9))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(batch)])
    reference = build("gemma3", **TWO_LOCAL_ONE_GLOBAL)
    for index, prompt in enumerate(batch):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert final[str(index)].outputs[0].token_ids == expected[0, len(prompt):].tolist()
    if layout == "token_major":  # per_layer pages hold more tokens than these sequences reach
        assert engine.stats()["blocks_released_behind_window"] > 0
    manager.check()
    assert manager.num_blocks_in_use == 0 and local_group.num_blocks_in_use == 0
    engine.close()
