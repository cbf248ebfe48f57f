"""Sliding windows, logit soft-capping and attention sinks in every CPU attention path, against a
float64 reference written query by query; positions behind every window are poisoned (NaN) to
show that no path reads them.

One mixed step (a prefill, a chunked prefill, two decodes, GQA 4:1, packed out of slot order) over
a real manager of each backend: the per-sequence SDPA path, the batched decode path, and the
FlashAttention classes with the documented-semantics reference as their kernel (window and
soft-capping go to the kernel; sinks, which FlashAttention-2 lacks, fall back to SDPA).
"""

from __future__ import annotations

import pytest
import torch

from flash_cases import case_manager, mixed_step
from vmemkv.attention import BlockTableAttention, ContiguousAttention, SequenceSpan
from vmemkv.attention.flash import FlashBlockTableAttention, FlashSlotAttention
from vmemkv.attention.flash_args import flatten_slots, slot_geometry
from vmemkv.attention.flash_kernels import FlashKernel
from vmemkv.attention.flash_reference import reference_varlen
from vmemkv.attention.slot_batch import DecodeBatch
from vmemkv.attention.variants import window_start

SCALE = 0.3
WINDOW = 6
LAYER = 1
NUM_Q_HEADS = 8  # mixed_step's GQA 4:1 over 2 kv heads
VARIANTS = {
    "window": dict(window=WINDOW),
    "softcap": dict(softcap=0.7),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, NUM_Q_HEADS, dtype=torch.float64)),
    "window+softcap+sinks": dict(window=WINDOW, softcap=0.7,
                                 sinks=torch.linspace(2.0, -1.0, NUM_Q_HEADS, dtype=torch.float64)),
}
FLASH_KERNEL = FlashKernel("reference", reference_varlen, window=True, softcap=True)


@pytest.fixture(params=["vmem", "paged"])
def manager(request):
    yield from case_manager(tokens_per_page=4, kv_backend=request.param)


def reference(spans, history, query, key, value, window=None, softcap=None, sinks=None):
    """``[1, T, Hq, D]``: every query against its visible keys, one at a time, in float64."""
    out = torch.zeros(1, query.shape[2], query.shape[1], query.shape[3], dtype=torch.float64)
    for span, (old_k, old_v) in zip(spans, history):
        rows = slice(span.query_start, span.query_start + span.num_queries)
        keys = torch.cat([old_k, key[0, :, rows].transpose(0, 1)])  # [length, Hk, D]
        values = torch.cat([old_v, value[0, :, rows].transpose(0, 1)])
        for i in range(span.num_queries):
            position = span.num_cached + i
            first = max(0, position - window + 1) if window else 0
            for head in range(query.shape[1]):
                kv_head = head // (query.shape[1] // keys.shape[1])
                scores = keys[first:position + 1, kv_head] @ query[0, head, span.query_start + i] * SCALE
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = torch.exp(scores - scores.max())
                denominator = weights.sum()
                if sinks is not None:
                    denominator = denominator + torch.exp(sinks[head] - scores.max())
                out[0, span.query_start + i, head] = (weights / denominator) @ values[first:position + 1, kv_head]
    return out


def cached_history(manager, spans):
    """Each span's cached K/V ``[num_cached, Hk, D]`` of layer ``LAYER``, read back before the step."""
    history = [SequenceSpan(s.slot, 0, s.num_cached, 0, s.block_table) for s in spans]
    attention = _sdpa_attention(manager, history, batched=False)
    return [tuple(t.clone() for t in attention.read(LAYER, i)) for i in range(len(history))]


def _sdpa_attention(manager, spans, batched: bool):
    if manager.config.kv_backend == "paged":
        attention = BlockTableAttention(spans, manager.block_views, manager.tokens_per_page, "cpu")
        if not batched:
            attention.sdpa_spans, attention.batches = list(range(len(spans))), []
        return attention
    reads = manager.batched_reads() if batched else None
    return ContiguousAttention(spans, manager.kv_views, "cpu", reads=reads)


def poison_behind_windows(manager, spans, window):
    """NaN in every cached position behind the window of the span's first query."""
    for span in spans:
        first = window_start(span.num_cached, window)
        if not first:
            continue
        nan = torch.full((first, 2, 16), float("nan"), dtype=torch.float64)
        _sdpa_attention(manager, [SequenceSpan(span.slot, 0, first, 0, span.block_table)],
                        batched=False).write(LAYER, nan, nan)


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@pytest.mark.parametrize("path", ["per-sequence", "batched", "flash"])
def test_every_path_matches_the_reference_and_reads_no_position_behind_a_window(manager, variant, path):
    spans, query, key, value = mixed_step(manager, torch.float64)
    options = VARIANTS[variant]
    history = cached_history(manager, spans)
    expected = reference(spans, history, query, key, value, **options)
    poison_behind_windows(manager, spans, options.get("window"))
    if path == "flash":
        if manager.config.kv_backend == "paged":
            attention = FlashBlockTableAttention(spans, manager.block_views, manager.tokens_per_page, "cpu",
                                                 FLASH_KERNEL)
        else:
            rows = slot_geometry(*manager.kv_views(LAYER))
            num_rows = flatten_slots(manager.kv_views(LAYER)[0], rows).shape[0]
            attention = FlashSlotAttention(spans, manager.kv_views, "cpu", FLASH_KERNEL, rows, num_rows)
    else:
        attention = _sdpa_attention(manager, spans, batched=path == "batched")
        assert bool(attention.batches) == (path == "batched")
    out = attention(LAYER, query, key, value, SCALE, **options)
    assert torch.isfinite(out).all(), "a position behind a window was read"
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_flash_kernels_without_a_feature_fall_back_to_sdpa(manager, monkeypatch):
    """A kernel without soft-capping (PyTorch's bundled one) or any kernel given sinks is never
    called for that layer: the SDPA path of the class computes it."""
    spans, query, key, value = mixed_step(manager, torch.float64)
    expected = reference(spans, cached_history(manager, spans), query, key, value, softcap=0.7)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was called for a layer it cannot compute")

    kernel = FlashKernel("no-softcap", refuse, window=True, softcap=False)
    if manager.config.kv_backend == "paged":
        attention = FlashBlockTableAttention(spans, manager.block_views, manager.tokens_per_page, "cpu", kernel)
    else:
        rows = slot_geometry(*manager.kv_views(LAYER))
        attention = FlashSlotAttention(spans, manager.kv_views, "cpu", kernel, rows,
                                       flatten_slots(manager.kv_views(LAYER)[0], rows).shape[0])
    torch.testing.assert_close(attention(LAYER, query, key, value, SCALE, softcap=0.7), expected,
                               rtol=1e-9, atol=1e-9)
    assert not kernel.runs(None, None, torch.zeros(NUM_Q_HEADS)) and kernel.runs(WINDOW, None, None)


def test_a_decode_batch_reads_from_the_window_start_only_when_every_member_starts_there():
    equal = DecodeBatch([0, 1], 9)
    equal.finish([SequenceSpan(0, 0, 1, 8), SequenceSpan(1, 1, 1, 8)], torch.device("cpu"))
    assert equal.window(4) == (5, None)  # positions 5..8 of both rows, no mask
    assert equal.window(None) == (0, None)  # every key of every row is read: no mask at all
    assert equal.window(9)[0] == 0  # a window no shorter than the longest row: plain decode
    ragged = DecodeBatch([0, 1], 9)
    ragged.finish([SequenceSpan(0, 0, 1, 8), SequenceSpan(1, 1, 1, 3)], torch.device("cpu"))
    assert ragged.window(4) is None  # row 1's window starts at 0, row 0's at 5: one by one
    assert ragged.window(None)[1][:, 0, 0].sum(dim=1).tolist() == [9, 4]
