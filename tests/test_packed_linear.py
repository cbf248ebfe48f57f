"""Linear layers on oneDNN's packed weights (``engine/models/packed_linear.py``): the same results as
``F.linear`` up to rounding, the engine's greedy tokens equal Hugging Face ``generate`` with them,
and a model object handed to the engine is never changed. Projections of one input (q|k|v,
gate|up) run as one GEMM and give each projection's own result, whatever the order of calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vmemkv.engine.models.packed_linear import (FusedPackedLinear, PackedLinear, PackedSlice, pack_linears,
                                                why_not_packed)

pytestmark = pytest.mark.skipif(bool(why_not_packed(nn.Sequential(nn.Linear(8, 8)))),
                                reason=why_not_packed(nn.Sequential(nn.Linear(8, 8))) or "available")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(dtype, tolerance, bias):
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    assert packed.weight.device.type == "meta" and packed.weight.shape == (200, 96) and packed.weight.dtype == dtype
    for shape in [(1, 96), (5, 96), (2, 7, 96), (1, 33, 96)]:  # decode rows, a packed step [1, T, hidden]
        x = torch.randn(shape, generator=generator).to(dtype)
        with torch.inference_mode():
            got, want = packed(x), F.linear(x, linear.weight, linear.bias)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance * want.abs().max().item(),
                                   rtol=tolerance)


def test_pack_linears_swaps_every_linear_and_keeps_a_tied_weight():
    embedding = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight  # tied, as an LM head
    model = nn.ModuleDict({"embed": embedding, "body": nn.Sequential(nn.Linear(16, 16), nn.ReLU()), "head": head})
    assert why_not_packed(model) == ""
    assert pack_linears(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model["embed"].weight.device.type == "cpu"  # the embedding keeps the shared weight
    x = torch.randn(3, 16)
    torch.testing.assert_close(model["head"](x), F.linear(x, embedding.weight), atol=1e-5, rtol=1e-5)


def test_a_layer_that_cannot_be_packed_leaves_the_model_unchanged(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    before = [type(m) for m in model.modules()]
    real = PackedLinear.__init__

    def fail_on_the_last(self, linear, kernel=None):
        if linear.out_features == 4:
            raise RuntimeError("oneDNN refused")
        real(self, linear, kernel)

    monkeypatch.setattr(PackedLinear, "__init__", fail_on_the_last)
    with pytest.raises(RuntimeError, match="refused"):
        pack_linears(model)
    assert [type(m) for m in model.modules()] == before  # the first layer was not swapped either


class Attention(nn.Module):  # the projections of a Llama-family attention and MLP, GQA-shaped
    def __init__(self, bias: bool, hidden: int = 96, kv: int = 32, mlp: int = 160):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(hidden, hidden, bias=bias), nn.Linear(hidden, hidden, bias=False)
        self.k_proj, self.v_proj = nn.Linear(hidden, kv, bias=bias), nn.Linear(hidden, kv, bias=bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(hidden, mlp, bias=False), nn.Linear(hidden, mlp, bias=False)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_projections_equal_each_f_linear_in_any_order(dtype, tolerance, bias):
    generator = torch.Generator().manual_seed(0)
    model = Attention(bias).to(dtype)
    want = {name: (layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone())
            for name, layer in model.named_modules() if isinstance(layer, nn.Linear)}
    assert pack_linears(model, fuse=True) == 6
    assert isinstance(model.o_proj, PackedLinear)  # not one of a group
    groups = {model.q_proj.group, model.mlp.gate_proj.group}
    assert model.k_proj.group is model.v_proj.group is model.q_proj.group
    assert model.mlp.up_proj.group is model.mlp.gate_proj.group and len(groups) == 2
    assert model.k_proj.weight.shape == (32, 96) and model.k_proj.weight.device.type == "meta"

    def check(name: str, x: torch.Tensor) -> None:
        got = model.get_submodule(name)(x)
        expected = F.linear(x, *want[name])
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * expected.abs().max().item(),
                                   rtol=tolerance)

    x, y = (torch.randn(2, 7, 96, generator=generator).to(dtype) for _ in range(2))
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj", "mlp.gate_proj", "mlp.up_proj"):  # HF's order
            check(name, x)
        assert all(group.cache.output is None and group.cache.input is None for group in groups)  # nothing kept
        check("q_proj", x)
        assert model.q_proj.group.cache.input is x  # kept for k and v
        check("k_proj", y)  # another input: its own GEMM, not x's
        check("q_proj", x)  # the cache now holds y's
        check("q_proj", x)  # a slice already taken is computed again
        check("v_proj", y)
        check("v_proj", x)
        check("k_proj", x)
        assert model.q_proj.group.cache.input is x
        check("q_proj", x)  # v, k, q: all three slices of x's output taken
        assert model.q_proj.group.cache.output is None
        for name in ("mlp.up_proj", "mlp.gate_proj", "mlp.gate_proj", "mlp.up_proj"):
            check(name, x[0])  # [T, hidden] rows, up first


def test_without_fuse_each_projection_is_packed_alone():
    model = Attention(bias=True)
    assert pack_linears(model) == 6
    assert all(type(m) is PackedLinear for name, m in model.named_modules() if name.endswith("proj"))


def test_mismatched_projections_are_packed_alone():
    model = Attention(bias=False)
    model.v_proj = nn.Linear(64, 32)  # another input width: not one GEMM with q and k
    assert pack_linears(model, fuse=True) == 6
    assert all(type(getattr(model, name)) is PackedLinear for name in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(model.mlp.gate_proj, PackedSlice)


def test_a_group_that_cannot_be_packed_leaves_the_model_unchanged(monkeypatch):
    model = Attention(bias=True)
    before = [type(m) for m in model.modules()]

    def refuse(self, linears, kernel=None):
        if len(linears) == 2:  # gate|up, after q|k|v was built
            raise RuntimeError("oneDNN refused")
        real(self, linears, kernel)

    real = FusedPackedLinear.__init__
    monkeypatch.setattr(FusedPackedLinear, "__init__", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        pack_linears(model, fuse=True)
    assert [type(m) for m in model.modules()] == before


def test_why_not_packed_says_why():
    assert "no nn.Linear" in why_not_packed(nn.Sequential(nn.ReLU()))
    meta = nn.Sequential(nn.Linear(4, 4, device="meta"))
    assert "for the CPU" in why_not_packed(meta)


def test_engine_packs_a_model_it_loads_and_matches_hf_but_leaves_a_model_object_alone():
    from test_engine_correctness import assert_clean, assert_matches_hf, make_engine, prompts, run
    from vmemkv.engine import EngineConfig, LLMEngine
    from vmemkv.engine.models.zoo import load_model

    batch = prompts(4)
    engine = make_engine("tiny-llama")
    assert engine.packed_linears.startswith("packed ")
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)
    engine.close()

    model, tokenizer = load_model("tiny-llama")
    engine = LLMEngine(EngineConfig(max_num_seqs=4, max_model_len=128), model=model, tokenizer=tokenizer)
    assert engine.packed_linears.startswith("off: a model object")
    assert any(type(m) is nn.Linear for m in model.modules())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    engine.close()
    off = make_engine("tiny-llama", packed_linears=False)
    assert off.packed_linears == "off"
    assert not any(isinstance(m, PackedLinear) for m in off.runner.model_runner.model.modules())
    off.close()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma2"])
def test_engine_with_fused_projections_matches_hf(name):
    """tiny-qwen2 has q/k/v biases; tiny-gemma2 another attention and MLP class (its reference runs
    eager attention, soft-capping)."""
    from test_engine_correctness import NEW_TOKENS, assert_clean, assert_matches_hf, make_engine, prompts, run

    engine = make_engine(name, fused_projections=True)
    assert engine.packed_linears.endswith("(q|k|v and gate|up fused)")
    model = engine.runner.model_runner.model
    groups = {m.group for m in model.modules() if isinstance(m, PackedSlice)}
    assert len(groups) == 2 * model.config.num_hidden_layers  # q|k|v and gate|up in every layer
    assert not any(type(m) is nn.Linear for m in model.modules())
    batch = prompts(4)
    outputs = run(engine, batch)
    if name == "tiny-gemma2":
        from test_hybrid_engine import tiny_gemma2_reference
        for prompt, output in zip(batch, outputs):
            assert output.outputs[0].token_ids == tiny_gemma2_reference(tuple(prompt), NEW_TOKENS)
    else:
        assert_matches_hf(name, batch, outputs)
    assert all(group.cache.output is None for group in groups)  # no output kept between steps
    assert_clean(engine)
    engine.close()
