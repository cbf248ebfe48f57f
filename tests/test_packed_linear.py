"""Linear layers on oneDNN's packed weights (``engine/models/packed_linear.py``): the same results as
``F.linear`` up to rounding, the engine's greedy tokens equal Hugging Face ``generate`` with them,
and a model object handed to the engine is never changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vmemkv.engine.models.packed_linear import PackedLinear, pack_linears, why_not_packed

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

    def fail_on_the_last(self, linear):
        if linear.out_features == 4:
            raise RuntimeError("oneDNN refused")
        real(self, linear)

    monkeypatch.setattr(PackedLinear, "__init__", fail_on_the_last)
    with pytest.raises(RuntimeError, match="refused"):
        pack_linears(model)
    assert [type(m) for m in model.modules()] == before  # the first layer was not swapped either


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
