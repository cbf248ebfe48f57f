"""Which kernel the engine packs float32 weights for (engine/models/kernel_choice.py): both timed on
the model's first layers when both can run, the faster taken; a requested kernel is used as asked
and still matches HF token for token; a bad name or one that cannot run is refused clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vmemkv.engine.models import kernel_choice, panel_linear
from vmemkv.engine.models.packed_linear import KERNELS, PackedLinear

needs_panels = pytest.mark.skipif(bool(panel_linear.unavailable()), reason=panel_linear.unavailable() or "built")


def kernels_of(engine) -> set[str]:
    return {m.kernel for m in engine.runner.model_runner.model.modules() if isinstance(m, PackedLinear)}


def test_the_first_layers_hold_the_bytes_asked_for():
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(10)))  # 16 KiB of weights each
    assert len(kernel_choice._first_linears(model, 40 << 10)) == 3  # 16 + 16 < 40 <= 48 KiB
    assert len(kernel_choice._first_linears(model, 1 << 30)) == 10  # all there are
    assert kernel_choice.last_level_cache_bytes() >= 1 << 16


@needs_panels
def test_every_candidate_is_timed_and_the_choice_follows_the_times(monkeypatch):
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    hint = panel_linear.prefetch_hint()
    seconds = kernel_choice.time_kernels(model, rows=(4, 9), repeats=2)
    assert set(seconds) == set(kernel_choice.CANDIDATES)
    assert all(len(times) == 2 and min(times) > 0 for times in seconds.values())
    assert panel_linear.prefetch_hint() == hint  # timing leaves the process's hint as it was

    def times(table):
        monkeypatch.setattr(kernel_choice, "remembered_times",
                            lambda model, candidates: ({c: table[c] for c in candidates}, None))

    for fastest in kernel_choice.CANDIDATES:  # one fastest at both sizes: it is taken
        times({c: (1.0, 1.0) if c == fastest else (2.0, 2.0) for c in kernel_choice.CANDIDATES})
        kernel, hint, why = kernel_choice.choose_kernel(model)
        assert (kernel, hint) == fastest and "least total" in why
    # panels/t0 fastest for a decode batch, oneDNN for a prefill chunk: both packed
    times({("panels", "t0"): (1.0, 5.0), ("panels", "nta"): (2.0, 6.0), ("onednn", None): (1.5, 3.0)})
    assert kernel_choice.choose_kernel(model)[:2] == ("split", "t0")
    monkeypatch.setattr(kernel_choice, "fits_twice", lambda model: False)  # no room for two packings
    assert kernel_choice.choose_kernel(model)[:2] == ("onednn", None)  # least total: 4.5 against 6.0
    # asked for: the panels' hint that is faster for a decode batch, oneDNN untimed
    assert kernel_choice.choose_kernel(model, "panels")[:2] == ("panels", "t0")
    assert kernel_choice.choose_kernel(model, "split")[:2] == ("split", "t0")
    assert kernel_choice.choose_kernel(model, "onednn") == ("onednn", None, "requested")
    bf16 = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert kernel_choice.choose_kernel(bf16)[:2] == ("onednn", None)  # the only one for bfloat16


@needs_panels
def test_a_split_layer_takes_the_panels_for_few_rows_and_onednn_for_many(monkeypatch):
    from vmemkv.engine.models import packed_linear

    linear = nn.Linear(96, 200)
    layer = PackedLinear(linear, "split")
    assert layer.packed.shape == (13, 96, 16) and layer.packed_large is not None  # both packings
    ran = []
    real = packed_linear._linear
    monkeypatch.setattr(packed_linear, "_linear", lambda x, packed, bias, kernel, *rest: ran.append(kernel)
                        or real(x, packed, bias, kernel, *rest))
    generator = torch.Generator().manual_seed(5)
    for rows in (1, packed_linear.SPLIT_ROWS - 1, packed_linear.SPLIT_ROWS, 200):
        x = torch.randn(rows, 96, generator=generator)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), linear(x), atol=1e-4, rtol=1e-5)
    assert ran == ["panels", "panels", "onednn", "onednn"]


@needs_panels
@pytest.mark.parametrize("hint", panel_linear.HINTS)
def test_either_prefetch_hint_computes_the_same_linear(hint):
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(200, 96, generator=generator), torch.randn(16, 96, generator=generator)
    before = panel_linear.prefetch_hint(hint)
    try:
        got = panel_linear.linear(x, panel_linear.pack(weight), None, 200)
    finally:
        panel_linear.prefetch_hint(before)
    torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="one of"):
        panel_linear.prefetch_hint("t1")
    assert panel_linear.prefetch_hint() == before  # the refusal changed nothing


@needs_panels
@pytest.mark.parametrize("kernel", [*KERNELS, "split"])
def test_engine_packs_for_the_requested_kernel_and_matches_hf(kernel):
    from test_engine_correctness import assert_clean, assert_matches_hf, make_engine, prompts, run

    engine = make_engine("tiny-llama", linear_kernel=kernel)
    assert kernels_of(engine) == {kernel}
    assert engine.packed_linears.startswith("packed ") and f"for {kernel}" in engine.packed_linears
    assert "requested" in engine.packed_linears
    batch = prompts(4)
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)
    engine.close()


def test_engine_auto_says_what_it_measured_and_a_bad_kernel_is_refused():
    from test_engine_correctness import make_engine
    from vmemkv.engine import EngineConfig
    from vmemkv.errors import ConfigError

    engine = make_engine("tiny-llama")
    assert len(kernels_of(engine)) == 1 and kernels_of(engine) <= {*KERNELS, "split"}
    if not panel_linear.unavailable():
        assert "at 16 / 256 rows: panels/t0" in engine.packed_linears
    engine.close()
    with pytest.raises(ConfigError, match="linear_kernel must be auto, panels, onednn or split"):
        EngineConfig(linear_kernel="mkl")
    bf16 = make_engine("tiny-llama", linear_kernel="panels", dtype="bfloat16")
    if why := panel_linear.unavailable(torch.bfloat16):  # no AVX-512 BF16: refused, said why
        assert bf16.packed_linears == f"off: {why}"
    else:
        assert bf16.packed_linears.startswith("packed ") and "for panels" in bf16.packed_linears
    bf16.close()


@needs_panels
def test_the_times_are_measured_once_per_machine_and_key(monkeypatch):
    from vmemkv.engine.models import machine_cache

    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    calls = []
    real = kernel_choice.time_kernels
    monkeypatch.setattr(machine_cache, "QUIET_SHARE", 2.0)  # a contended measurement is not kept
    kernel_choice.choose_kernel(model)
    kernel_choice.choose_kernel(model)
    assert not machine_cache.cache_file().exists()
    monkeypatch.setattr(machine_cache, "QUIET_SHARE", 0.0)  # from here on, every one counts as quiet
    monkeypatch.setattr(kernel_choice, "time_kernels", lambda *args: calls.append(1) or real(*args, rows=(4, 9)))
    first = kernel_choice.choose_kernel(model)
    assert len(calls) == 1 and "(measured" not in first[2]
    again = kernel_choice.choose_kernel(model)  # read back: the same times, choice and when
    assert len(calls) == 1 and again[:2] == first[:2] and again[2].startswith(first[2] + " (measured 20")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count is another key
    kernel_choice.choose_kernel(model)
    assert len(calls) == 2
    kernel_choice.choose_kernel(nn.Sequential(nn.Linear(128, 64)))  # another shape too
    assert len(calls) == 3
    machine_cache.cache_file().write_text("{not json")  # damaged: measured again and rewritten
    kernel_choice.choose_kernel(model)
    assert len(calls) == 4
    kernel_choice.choose_kernel(model)
    assert len(calls) == 4
