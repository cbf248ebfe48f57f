"""Recurrent hybrids in the engine (tiny LFM2: short convolutions; tiny Qwen3-Next and Qwen3.5's
text model: gated delta nets; tiny Kimi Linear: Kimi delta attention beside MLA layers; tiny
Granite-4.0-H, Nemotron-H and Falcon-H1: Mamba2, Nemotron-H with MLP-only layers that hold no
memory, Falcon-H1 with attention and Mamba2 in every layer):
each state layer's state is a slot of its state group, the model's own mixer runs once per
sequence of the packed batch over it, and the greedy tokens equal Hugging Face ``generate`` with
chunked prefill, ``n > 1`` (the state forked), and preemption by swap (the state copied out and
back) and by recompute (dropped), and prefix hits (a shared prefix continues from the state saved
where an earlier prompt's chunk ended)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from vmemkv.cache.kv_spec import layer_specs
from vmemkv.engine import SamplingParams
from vmemkv.engine.distributed.sharding import check_shardable
from vmemkv.engine.models.hf_support import check_attention_supported
from vmemkv.engine.models.state_mixers import state_specs, takes_cache
from vmemkv.engine.models.zoo import BUILTIN_MODELS, load_model, model_config
from vmemkv.errors import ConfigError, InvalidInputError, UnsupportedModelError

from test_engine_correctness import assert_clean, greedy, make_engine, prompts, run
from test_mla_engine import assert_matches_hf, assert_preemption_matches_hf, hf_greedy

STATE_MODELS = ["tiny-lfm2", "tiny-qwen3-next", "tiny-granite-hybrid"]
QWEN3_5 = pytest.mark.skipif("tiny-qwen3.5" not in BUILTIN_MODELS,
                             reason=f"transformers {transformers.__version__} has no Qwen3.5")
try:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
except ImportError:
    NemotronHMamba2Mixer = None
NEMOTRON_H = pytest.mark.skipif(
    "tiny-nemotron-h" not in BUILTIN_MODELS or not takes_cache(NemotronHMamba2Mixer),
    reason=f"transformers {transformers.__version__} has no Nemotron-H taking its state as `cache`")
try:
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer
except ImportError:
    FalconH1Mixer = None
FALCON_H1 = pytest.mark.skipif(
    "tiny-falcon-h1" not in BUILTIN_MODELS or not takes_cache(FalconH1Mixer),
    reason=f"transformers {transformers.__version__} has no Falcon-H1 taking its state as `cache`")
try:
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
except ImportError:
    KimiLinearDeltaAttention = None
KIMI_LINEAR = pytest.mark.skipif(
    "tiny-kimi-linear" not in BUILTIN_MODELS or not takes_cache(KimiLinearDeltaAttention),
    reason=f"transformers {transformers.__version__} has no Kimi Linear taking its state as `cache`")
# families that some transformers versions lack, each with its skip
NEWER_MODELS = [pytest.param("tiny-qwen3.5", marks=QWEN3_5),
                pytest.param("tiny-nemotron-h", marks=NEMOTRON_H),
                pytest.param("tiny-falcon-h1", marks=FALCON_H1),
                pytest.param("tiny-kimi-linear", marks=KIMI_LINEAR)]
STATE_MIXERS_ROUTED = pytest.mark.skipif(
    not all(map(takes_cache, (Lfm2ShortConv, Qwen3NextGatedDeltaNet, GraniteMoeHybridMambaLayer))),
    reason=f"transformers {transformers.__version__}'s LFM2 / Qwen3-Next / Granite-4.0-H mixers "
           "take their state in another form than `cache` (the engine refuses them at load)")
pytestmark = STATE_MIXERS_ROUTED


@pytest.mark.parametrize("model", [*STATE_MODELS, *NEWER_MODELS])
def test_ragged_chunked_batch_matches_hf(model):
    engine = make_engine(model, max_num_batched_tokens=16)  # prompts continue from saved states
    batch = prompts(4, lengths=(5, 40, 17, 33))
    assert_matches_hf(model, batch, run(engine, batch))
    kinds = [type(group.spec).__name__ for group in engine.manager.groups]
    latent = model == "tiny-kimi-linear"  # its attention layers are MLA's: latent rows
    assert kinds == ["MLALatentSpec" if latent else "FullAttentionSpec", "RecurrentStateSpec"]
    assert_clean(engine)


@pytest.mark.parametrize("model", [*STATE_MODELS, *NEWER_MODELS])
def test_the_specs_are_the_states_transformers_keeps(model):
    """Each state layer's parts have the shapes and dtypes transformers' own cache holds after a
    bf16 prefill (the delta-rule and SSM states in float32)."""
    hf, _ = load_model(model, dtype=torch.bfloat16)
    cache = hf(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    specs = [layer_specs(entry)[1] for entry in state_specs(hf.config, torch.bfloat16)]
    assert any(specs)
    for layer, spec in enumerate(specs):
        if spec is None:  # attention, or a layer with no memory
            continue
        held = [cache.layers[layer].conv_states[0], cache.layers[layer].recurrent_states[0]]
        held = [tensor for tensor in held if tensor is not None]
        assert [(tuple(t.shape[1:]), t.dtype) for t in held] == [(p.shape, p.dtype) for p in spec.parts]


def test_the_state_group_follows_the_attention_group():
    engine = make_engine("tiny-lfm2")
    state = engine.manager.groups[1]
    assert state.layers == (0, 2) and engine.manager.groups[0].layers == (1,)
    assert [tuple(v.shape) for v in engine.manager.state_views(2)] == [(8, 128, 3)]
    engine.close()


@pytest.mark.parametrize("model", [*STATE_MODELS, *NEWER_MODELS])
def test_parallel_sampling_forks_the_state(model):
    engine = make_engine(model)
    batch = prompts(2, lengths=(37, 21))
    outputs = run(engine, batch, greedy(n=3))
    assert all(len(output.outputs) == 3 for output in outputs)
    assert engine.manager.cache_stats().forks == 4
    assert_matches_hf(model, batch, outputs)
    assert_clean(engine)


@pytest.mark.parametrize("model,mode", [("tiny-lfm2", "swap"), ("tiny-lfm2", "recompute"),
                                        ("tiny-qwen3-next", "swap"), ("tiny-qwen3-next", "recompute"),
                                        ("tiny-granite-hybrid", "swap"), ("tiny-granite-hybrid", "recompute"),
                                        pytest.param("tiny-qwen3.5", "swap", marks=QWEN3_5),
                                        pytest.param("tiny-qwen3.5", "recompute", marks=QWEN3_5),
                                        pytest.param("tiny-nemotron-h", "swap", marks=NEMOTRON_H),
                                        pytest.param("tiny-nemotron-h", "recompute", marks=NEMOTRON_H),
                                        pytest.param("tiny-falcon-h1", "swap", marks=FALCON_H1),
                                        pytest.param("tiny-falcon-h1", "recompute", marks=FALCON_H1),
                                        pytest.param("tiny-kimi-linear", "swap", marks=KIMI_LINEAR),
                                        pytest.param("tiny-kimi-linear", "recompute", marks=KIMI_LINEAR)])
def test_preemption_matches_hf(model, mode):
    assert_preemption_matches_hf(model, mode)


@pytest.mark.parametrize("model", [*STATE_MODELS, *NEWER_MODELS])
def test_a_shared_prefix_continues_from_the_saved_state_and_tokens_still_match(model):
    probe = make_engine(model)
    page = probe.manager.tokens_per_page
    probe.close()
    engine = make_engine(model, state_cache_interval=page)  # a state saved at every page
    system = prompts(1, lengths=(2 * page + 5,), offset=5)[0]
    batch = [system + tail for tail in prompts(3, lengths=(3, 11, 7))]
    outputs = run(engine, batch[:1]) + run(engine, batch[1:])
    # the first prompt's chunk ended at 2 pages, its state saved there: the others start there
    assert [output.num_cached_tokens for output in outputs] == [0, 2 * page, 2 * page]
    stats = engine.manager.cache_stats()
    assert stats.state_hits == 2 and stats.prefix_hit_tokens == 4 * page and stats.states_saved > 0
    assert engine.stats()["state_bytes_per_saved_state"] == engine.manager.groups[1].state_bytes
    assert_matches_hf(model, batch, outputs)
    assert_clean(engine)


@NEMOTRON_H
def test_a_layer_without_memory_is_in_no_group():
    """Nemotron-H's MLP-only layer keeps nothing: neither group holds it, and asking for its
    memory is refused naming the layers that hold some."""
    engine = make_engine("tiny-nemotron-h")
    attention, state = engine.manager.groups
    assert attention.layers == (2,) and state.layers == (0, 3)
    with pytest.raises(InvalidInputError, match="layer 1 holds no memory.*0, 2, 3"):
        engine.manager.state_views(1)
    engine.close()


@FALCON_H1
def test_a_layer_with_attention_and_a_state_is_in_both_groups():
    """Falcon-H1 runs attention and Mamba2 side by side in every layer: each layer's K/V is in
    the attention group and its state in the state group."""
    engine = make_engine("tiny-falcon-h1")
    attention, state = engine.manager.groups
    assert attention.layers == state.layers == (0, 1)
    assert len(engine.manager.kv_views(1)) == 2
    assert [tuple(v.shape[1:]) for v in engine.manager.state_views(1)] == [(160, 4), (8, 16, 16)]
    engine.close()


def test_a_later_turn_continues_from_a_state_saved_while_decoding():
    engine = make_engine("tiny-lfm2")
    page = engine.manager.tokens_per_page
    engine.close()
    engine = make_engine("tiny-lfm2", state_cache_interval=page)
    first = prompts(1, lengths=(page + 3,), offset=2)[0]
    params = SamplingParams(max_tokens=2 * page, temperature=0, ignore_eos=True)
    answer = run(engine, [first], params)[0].outputs[0].token_ids
    turn = first + answer + [11, 12, 13, 14, 15]  # computed up to 3 pages + 2: saved at 3 pages
    output = run(engine, [turn], params)[0]
    assert output.num_cached_tokens == 3 * page
    assert output.outputs[0].token_ids == hf_greedy("tiny-lfm2", tuple(turn), 2 * page)
    assert_clean(engine)


def test_without_saved_states_there_are_no_prefix_hits():
    engine = make_engine("tiny-lfm2", state_cache_interval=0)
    page = engine.manager.tokens_per_page
    system = prompts(1, lengths=(2 * page + 5,), offset=5)[0]
    batch = [system + tail for tail in prompts(3, lengths=(3, 11, 7))]
    outputs = run(engine, batch[:1]) + run(engine, batch[1:])
    assert all(output.num_cached_tokens == 0 for output in outputs)
    assert_matches_hf("tiny-lfm2", batch, outputs)
    assert_clean(engine)


def test_block_tables_tensor_parallel_and_other_state_families_are_refused():
    with pytest.raises(ConfigError, match="kv_backend='vmem'"):
        make_engine("tiny-lfm2", kv_backend="paged")
    with pytest.raises(UnsupportedModelError, match="recurrent state.*tensor_parallel_size=1"):
        check_shardable(model_config("tiny-qwen3-next"), 2)
    for replaces_attention, served in ((True, True), (False, False)):  # the engine, VmemkvCache
        for name in STATE_MODELS:
            config = model_config(name)
            if served:
                check_attention_supported(config, 64, replaces_attention=replaces_attention)
            else:
                with pytest.raises(UnsupportedModelError, match="state"):
                    check_attention_supported(config, 64, replaces_attention=replaces_attention)
    other = model_config("tiny-qwen3-next")
    other.model_type = "olmo_hybrid"  # a family whose mixers are not routed
    with pytest.raises(UnsupportedModelError, match="gated delta net"):
        check_attention_supported(other, 64, replaces_attention=True)


def test_vmemkv_cache_refuses_them_when_the_cache_is_built_naming_the_layer_kind():
    from vmemkv_transformers.model import manager_for

    from test_engine_correctness import reference_model

    with pytest.raises(UnsupportedModelError, match="'conv' layers .*short convolution state"):
        manager_for(reference_model("tiny-lfm2"), 2, 64)


def test_a_mixer_taking_its_state_another_way_is_refused_at_load():
    """transformers before the `cache` argument (5.17 passes the state otherwise): refused, not
    run without its state."""
    from vmemkv.engine.models.state_mixers import route_state_mixers

    class Lfm2ShortConv(torch.nn.Module):  # the older signature
        def forward(self, hidden_states, past_key_values=None, attention_mask=None):
            return hidden_states

    model = torch.nn.Sequential(Lfm2ShortConv())
    with pytest.raises(UnsupportedModelError, match="Lfm2ShortConv takes its state in another form"):
        route_state_mixers(model)
    assert not hasattr(model[0], "vmemkv_own_forward")  # nothing was routed
