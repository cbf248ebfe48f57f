"""Which FlashAttention kernel vmemkv would call, and when it refuses, decided without a GPU:
schema and signature detection, the flash-attn issue-772 guard, ``--attention`` resolution on
CPU, and the single staged upload of a step's index tensors."""

from __future__ import annotations

import pytest
import torch

from vmemkv.attention import flash_kernels
from vmemkv.attention.choice import choose_attention
from vmemkv.attention.flash_args import FlashUnsupportedError
from vmemkv.attention.flash_kernels import (KernelFeatures, check_kvcache_batch_index, flash_kernel_for,
                                            kvcache_batch_index_safe, package_features_of, schema_features,
                                            shape_supported)
from vmemkv.attention.metadata import StepMetadata
from vmemkv.cli import add_engine_args
from vmemkv.engine import EngineConfig
from vmemkv.errors import ConfigError

HEAD = ("aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
        "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
        "bool return_debug_mask, *, float? scale=None")
TAIL = ") -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)"
SCHEMAS = {  # the op's schema as torch releases changed it
    "2.4": HEAD + TAIL,
    "2.5": HEAD + ", SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? seqused_k=None, "
                  "Tensor? alibi_slopes=None" + TAIL,
    "2.12": HEAD + ", SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? seqused_k=None, "
                   "Tensor? alibi_slopes=None, Tensor? block_table=None, int? num_splits=None" + TAIL,
}


@pytest.mark.parametrize("release,seqused,table", [("2.4", False, False), ("2.5", True, False),
                                                   ("2.12", True, True)])
def test_bundled_features_from_schema(release, seqused, table):
    features = schema_features(torch._C.parse_schema(SCHEMAS[release]))
    assert features.available and (features.seqused_k, features.block_table) == (seqused, table)


def test_this_torch_schema_is_read():
    schema = torch.ops.aten._flash_attention_forward.default._schema
    features = schema_features(schema)
    assert features.available
    assert features.seqused_k == ("seqused_k" in str(schema))
    assert features.block_table == ("block_table" in str(schema))


def test_package_features_from_signatures():
    def varlen_2_5(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, return_softmax, block_table): ...

    def varlen_2_7(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                   seqused_k=None): ...

    def with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None): ...

    old = package_features_of(varlen_2_5, with_kvcache, "2.5.0")
    assert old.available and not old.seqused_k and old.block_table and old.kvcache_batch_idx
    new = package_features_of(varlen_2_7, with_kvcache, "2.7.4")
    assert new.seqused_k and new.block_table
    assert not package_features_of(None, None, "?").available


def test_kernel_preference_and_reasons(monkeypatch):
    bundled = KernelFeatures("bundled", True, seqused_k=True, block_table=False, version="2.11")
    package = KernelFeatures("package", True, seqused_k=True, block_table=True, kvcache_batch_idx=True,
                             version="2.8.3")
    monkeypatch.setattr(flash_kernels, "bundled_features", lambda: bundled)
    monkeypatch.setattr(flash_kernels, "package_features", lambda: package)
    kernel, _ = flash_kernel_for(paged=False)
    assert kernel.name == "bundled" and not kernel.kvcache_decode
    kernel, _ = flash_kernel_for(paged=True)  # torch 2.11-like: no block_table in the schema
    assert kernel.name == "package"
    missing = KernelFeatures("package", False, reason="flash_attn not importable")
    monkeypatch.setattr(flash_kernels, "package_features", lambda: missing)
    kernel, why = flash_kernel_for(paged=True)
    assert kernel is None and "no block_table" in why and "not importable" in why
    monkeypatch.setattr(flash_kernels, "bundled_features", lambda: KernelFeatures("bundled", False, reason="x"))
    monkeypatch.setattr(flash_kernels, "package_features", lambda: package)
    assert flash_kernel_for(paged=False, kvcache_safe=True)[0].kvcache_decode
    assert not flash_kernel_for(paged=False, kvcache_safe=False)[0].kvcache_decode


def test_issue_772_guard_on_slot_strides():
    # Llama-3-8B token-major slots: a slot is 8192 tokens x 32 layers x K/V x 8 heads x 128.
    token = 32 * 2 * 8 * 128
    llama = ((256, 8192, 8, 128), (8192 * token, token, 128, 1))
    assert not kvcache_batch_index_safe(*llama)
    with pytest.raises(FlashUnsupportedError, match="issue 772"):
        check_kvcache_batch_index(*llama)
    # The issue's own case: a batch stride of 2^30 elements; slot 2 starts past 2^31.
    assert kvcache_batch_index_safe((2, 4096, 32, 128), (1 << 30, 4096, 128, 1))
    assert not kvcache_batch_index_safe((3, 4096, 32, 128), (1 << 30, 4096, 128, 1))
    assert kvcache_batch_index_safe((4, 1024, 2, 64), (1024 * 128, 128, 64, 1))


@pytest.mark.parametrize("dtype,head_dim,heads,ok", [
    (torch.bfloat16, 64, (8, 2), True), (torch.float16, 128, (32, 8), True),
    (torch.float32, 64, (8, 2), False), (torch.bfloat16, 60, (8, 2), False),
    (torch.bfloat16, 512, (8, 2), False), (torch.bfloat16, 64, (9, 2), False)])
def test_shapes_flash_attention_2_runs(dtype, head_dim, heads, ok):
    assert (shape_supported(dtype, head_dim, *heads) == "") == ok


# --- --attention on CPU ------------------------------------------------------------------------------

def test_auto_is_native_on_cpu_and_explicit_gpu_kernels_are_refused():
    from vmemkv.attention.cpu_decode import unavailable

    cpu = torch.device("cpu")
    args = (cpu, "vmem", torch.bfloat16, 8, 2, 64, 16, None)
    assert choose_attention("auto", *args).kind == ("sdpa" if unavailable() else "native")
    assert choose_attention("sdpa", *args).label == "sdpa"
    half = (cpu, "vmem", torch.float16, 8, 2, 64, 16, None)  # a dtype the native routine does not read
    assert choose_attention("auto", *half).kind == "sdpa"
    with pytest.raises(ConfigError, match="cannot run here"):
        choose_attention("native", *half)
    with pytest.raises(ConfigError, match="CPU decode routine"):
        EngineConfig(attention="native", device="cuda")
    for kind in ("flash", "triton"):
        with pytest.raises(ConfigError, match="CUDA"):
            choose_attention(kind, *args)
        with pytest.raises(ConfigError, match="CUDA"):
            EngineConfig(attention=kind)
    with pytest.raises(ConfigError, match="one of"):
        choose_attention("fast", *args)
    with pytest.raises(ConfigError, match="auto, flash, triton, native or sdpa"):
        EngineConfig(attention="fast")
    assert EngineConfig(attention="flash", device="cuda").attention == "flash"


def test_cli_offers_flash():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--attention", "flash"]).attention == "flash"


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_engine_on_cpu_runs_native_decodes_unless_asked_for_sdpa(attention):
    from vmemkv.attention.cpu_decode import unavailable
    from vmemkv.engine import LLMEngine
    engine = LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=64, attention=attention))
    try:
        native = attention == "auto" and not unavailable()
        assert engine.attention_kernel == ("native" if native else "sdpa") and engine.decode_kernel == native
    finally:
        engine.close()


# --- one upload per step ---------------------------------------------------------------------------

def test_step_metadata_is_one_buffer_of_aligned_views():
    staged = StepMetadata()
    staged.add("rows", [3, 1, 2])
    staged.add("lens", [5, 6], torch.int32)
    staged.add("empty", [], torch.int32)
    staged.add("table", [[1, 2, 0], [4, 5, 6]], torch.int32)
    host, offsets = staged.pack()  # what a device upload copies in one transfer
    packed = staged._views(host, offsets)
    for tensors in (staged.upload("cpu"), packed):  # on CPU each array is its own tensor
        assert tensors["rows"].tolist() == [3, 1, 2] and tensors["rows"].dtype == torch.int64
        assert tensors["lens"].tolist() == [5, 6] and tensors["lens"].dtype == torch.int32
        assert tensors["empty"].shape == (0,)
        assert tensors["table"].shape == (2, 3) and tensors["table"][1].tolist() == [4, 5, 6]
    storages = {t.untyped_storage().data_ptr() for t in packed.values()}
    assert storages == {host.untyped_storage().data_ptr()}  # one buffer
    assert all(t.data_ptr() % 16 == 0 for t in packed.values())
    with pytest.raises(ValueError, match="int32 or int64"):
        staged.add("bad", [1.5], torch.float32)


def test_attention_objects_stage_everything_in_one_upload(monkeypatch):
    from vmemkv.attention import ContiguousAttention, SequenceSpan
    uploads = []
    original = StepMetadata.upload
    monkeypatch.setattr(StepMetadata, "upload", lambda self, device: uploads.append(1) or original(self, device))
    spans = [SequenceSpan(1, 0, 1, 4), SequenceSpan(0, 1, 3, 0)]
    attention = ContiguousAttention(spans, lambda layer: None, torch.device("cpu"), decode_kernel=True)
    # the model's inputs travel in the same transfer as the attention's index tensors
    inputs = attention.upload(input_ids=[7, 8, 9, 10], positions=[4, 0, 1, 2], logit_rows=[0, 3])
    assert len(uploads) == 1
    assert inputs["input_ids"].tolist() == [7, 8, 9, 10] and inputs["logit_rows"].tolist() == [0, 3]
    assert attention.write_slots.tolist() == [1, 0, 0, 0] and attention.write_positions.tolist() == [4, 0, 1, 2]
    assert attention.decode_rows.tolist() == [0] and attention.decode_slots.tolist() == [1]
    assert attention.decode_lens.tolist() == [5] and attention.sdpa_spans == [1]
