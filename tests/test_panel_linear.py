"""The native linear over panel-packed weights (``engine/models/panel_linear.py``): in float32 equal
to ``F.linear`` up to rounding for every row count (the four-row blocks and their remainders),
output widths that are not a multiple of the panel (padding never shows), biases, and on two
threads; in bfloat16 (AVX-512 BF16) the same up to bfloat16 rounding, odd input widths included; a
wrong input is refused with a clear error; the engine packs float32 models for it, bfloat16 ones
where the CPU has AVX-512 BF16 (else for oneDNN), and falls back to oneDNN where the kernel is not
built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vmemkv.engine.models import panel_linear
from vmemkv.engine.models.packed_linear import PackedLinear, kernel_for, pack_linears, why_not_packed

pytestmark = pytest.mark.skipif(bool(panel_linear.unavailable()), reason=panel_linear.unavailable() or "built")


@pytest.fixture(params=[8, 4], ids=["rows8", "rows4"])
def rows_per_block(request):
    """Both row blocks: 8 (AVX-512's, where this CPU has it) and 4 (AVX2's and the baseline's)."""
    extension = panel_linear._extension()
    if request.param == 8 and extension.rows_per_block() != 8:
        pytest.skip("8 rows at a time need AVX-512, which this CPU lacks")
    before = extension.rows_per_block(request.param)
    yield request.param
    extension.rows_per_block(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features, in_features", [(200, 96), (7, 33), (32, 576), (49, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_panel_linear_equals_f_linear(rows_per_block, threads, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    panels = panel_linear.pack(weight)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 37]:
            x = torch.randn(rows, in_features, generator=generator)
            got = panel_linear.linear(x, panels, b, out_features)
            want = F.linear(x, weight, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5 * (1 + want.abs().max().item()), rtol=1e-5)
    finally:
        torch.set_num_threads(before)


needs_bf16 = pytest.mark.skipif(bool(panel_linear.unavailable(torch.bfloat16)),
                               reason=panel_linear.unavailable(torch.bfloat16) or "runs")


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features, in_features", [(200, 96), (7, 33), (32, 576), (49, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_panels_equal_f_linear_up_to_rounding(threads, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    panels = panel_linear.pack(weight)
    assert panels.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [1, 2, 3, 7, 8, 9, 16, 37]:
            x = torch.randn(2, rows, in_features, generator=generator).bfloat16()
            got = panel_linear.linear(x, panels, b, out_features, in_features)
            exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
            assert got.dtype == torch.bfloat16 and got.shape == exact.shape
            # float32 sums rounded to bfloat16 once: within a bfloat16 step of the exact result
            torch.testing.assert_close(got.double(), exact, atol=1e-2 * (1 + exact.abs().max().item()), rtol=1e-2)
    finally:
        torch.set_num_threads(before)


def test_leading_dimensions_and_a_strided_input():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=generator)
    panels = panel_linear.pack(weight)
    x = torch.randn(2, 5, 48, generator=generator)[..., ::2]  # [2, 5, 24], not contiguous
    torch.testing.assert_close(panel_linear.linear(x, panels, None, 40), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert panel_linear.linear(torch.empty(0, 24), panels, None, 40).shape == (0, 40)


def test_wrong_inputs_are_refused():
    panels = panel_linear.pack(torch.randn(20, 8))
    with pytest.raises(ValueError, match="float32"):
        panel_linear.linear(torch.randn(3, 8, dtype=torch.float64), panels, None, 20)
    with pytest.raises(ValueError, match="8 inputs"):
        panel_linear.linear(torch.randn(3, 9), panels, None, 20)
    with pytest.raises(ValueError, match="for a torch.bfloat16 CPU weight"):
        panel_linear.linear(torch.randn(3, 8), panel_linear.pack(torch.randn(20, 8).bfloat16()), None, 20)
    even = panel_linear.pack(torch.randn(20, 8).bfloat16())  # an input a feature short is no odd width
    with pytest.raises(ValueError, match="8 inputs"):
        panel_linear.linear(torch.randn(3, 7).bfloat16(), even, None, 20)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        panel_linear.pack(torch.randn(20, 8, dtype=torch.float16))
    assert "float32 and bfloat16 only" in panel_linear.unavailable(torch.float16)
    before = panel_linear._extension().rows_per_block()
    with pytest.raises(ValueError, match="rows per block"):
        panel_linear._extension().rows_per_block(5)
    assert panel_linear._extension().rows_per_block() == before  # the refusal changed nothing


def test_packed_linear_picks_the_kernel_by_dtype_and_falls_back_without_the_build(monkeypatch):
    bf16_kernel = "onednn" if panel_linear.unavailable(torch.bfloat16) else "panels"  # AVX-512 BF16 or not
    assert kernel_for(torch.float32) == "panels" and kernel_for(torch.bfloat16) == bf16_kernel
    assert PackedLinear(nn.Linear(16, 16)).kernel == "panels"
    assert PackedLinear(nn.Linear(16, 16).to(torch.bfloat16)).kernel == bf16_kernel
    with pytest.raises(ValueError, match="one of"):
        PackedLinear(nn.Linear(16, 16), kernel="mkl")
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):  # panels asked for a float16 weight
        PackedLinear(nn.Linear(16, 16).to(torch.float16), kernel="panels")
    monkeypatch.setattr(panel_linear, "_extension", lambda: None)
    assert "not built" in panel_linear.unavailable()
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        want = model(x)
    assert why_not_packed(model) == "" and pack_linears(model) == 2
    assert {m.kernel for m in model.modules() if isinstance(m, PackedLinear)} == {"onednn"}
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
