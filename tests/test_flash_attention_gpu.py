"""FlashAttention-2 over the slots and block tables on a GPU: the kernel against the float64
reference (through the same argument builders the CPU tests check), against the SDPA path and the
Triton decode path, and in the engine. Everything here skips without CUDA; ``gpu_check.sh`` runs
it (``-m gpu``)."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from conftest import cuda_bindings_missing

from flash_cases import free_cases, mixed_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCALE = 0.3
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


needs_bindings = pytest.mark.skipif(cuda_bindings_missing(), reason="needs cuda-python (cuda-bindings)")


def flash_kernel(paged: bool):
    from vmemkv.attention.flash_kernels import flash_kernel_for
    kernel, why = flash_kernel_for(paged)
    if kernel is None:
        pytest.skip(f"no FlashAttention-2 kernel for {'block tables' if paged else 'slots'}: {why}")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FlashAttention-2 needs sm80+")
    return kernel


@contextlib.contextmanager
def cuda_manager(kv_backend: str = "vmem", layout: str = "token_major", dtype=torch.bfloat16):
    """8 KiB tokens in 2 MiB pages: 256 tokens a block, what FlashAttention-2's block tables need.
    Closed at the end; after a failure, quietly (the failure's frames still hold views)."""
    from vmemkv import CacheConfig, KVCacheManager
    manager = KVCacheManager(CacheConfig(
        num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, page_size=2 << 20, num_blocks=24,
        max_num_seqs=6, max_model_len=512, device="cuda", kv_backend=kv_backend, layout=layout))
    failed = True
    try:
        yield manager
        failed = False
    finally:
        try:
            free_cases(manager)
            manager.close()
        except Exception:
            if not failed:
                raise


def reference_step(spans, query, k_in, v_in, args, window=None, softcap=None):
    """The float64 reference over exactly the kernel's arguments, back in packed order."""
    from vmemkv.attention.flash_reference import varlen_attention_reference
    host = {name: t.cuda() for name, t in args.tensors().items()}
    q = query[0].transpose(0, 1)
    if "query_rows" in host:
        q = q.index_select(0, host["query_rows"])
    out = varlen_attention_reference(q, k_in, v_in, host["cu_seqlens_q"], host["cu_seqlens_k"], SCALE,
                                     seqused_k=host["seqused_k"], block_table=host.get("block_table"),
                                     window=window, softcap=softcap)
    if "query_rows" in host:
        out = torch.empty_like(out).index_copy_(0, host["query_rows"], out)
    return out[None]


def test_probe_of_each_available_kernel():
    from vmemkv.attention.choice import probe
    for paged in (False, True):
        try:
            kernel = flash_kernel(paged)
        except pytest.skip.Exception:
            continue
        for dtype in (torch.bfloat16, torch.float16):
            assert probe(kernel, torch.cuda.current_device(), dtype, 8, 2, 64, 256 if paged else 0) == ""


@needs_bindings
@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_over_slots_matches_reference_sdpa_and_triton(layout, dtype):
    from vmemkv.attention import ContiguousAttention
    from vmemkv.attention.flash import FlashSlotAttention
    from vmemkv.attention.flash_args import flatten_slots, slot_geometry, slot_varlen_args

    kernel = flash_kernel(paged=False)
    with cuda_manager("vmem", layout, dtype) as manager:
        spans, query, key, value = mixed_step(manager, dtype, device="cuda")
        device = torch.device("cuda")
        sdpa = ContiguousAttention(spans, manager.kv_views, device)(1, query, key, value, SCALE)
        k_view, v_view = manager.kv_views(1)
        rows = slot_geometry(k_view, v_view)
        k_flat, v_flat = flatten_slots(k_view, rows), flatten_slots(v_view, rows)
        args = slot_varlen_args(spans, rows, k_flat.shape[0])
        expected = reference_step(spans, query, k_flat, v_flat, args)
        flash = FlashSlotAttention(spans, manager.kv_views, device, kernel, rows, k_flat.shape[0])
        out = flash(1, query, key, value, SCALE)
        torch.cuda.synchronize()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(sdpa.double(), expected, atol=tol, rtol=tol)
        if importlib.util.find_spec("triton") is not None:  # decodes by Triton, the rest by SDPA
            mixed = ContiguousAttention(spans, manager.kv_views, device, decode_kernel=True)
            torch.testing.assert_close(mixed(1, query, key, value, SCALE).double(), expected,
                                       atol=tol, rtol=tol)
        del k_view, v_view, k_flat, v_flat, flash


@needs_bindings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_over_block_tables_matches_reference(dtype):
    from vmemkv.attention import BlockTableAttention
    from vmemkv.attention.flash import FlashBlockTableAttention
    from vmemkv.attention.flash_args import block_varlen_args, fa2_block_size_supported

    kernel = flash_kernel(paged=True)
    with cuda_manager("paged", dtype=dtype) as manager:
        block_size = manager.tokens_per_page
        assert fa2_block_size_supported(block_size), f"{block_size} tokens a block"
        spans, query, key, value = mixed_step(manager, dtype, device="cuda")
        device = torch.device("cuda")
        sdpa = BlockTableAttention(spans, manager.block_views, block_size, device)(1, query, key, value, SCALE)
        k_blocks, v_blocks = manager.block_views(1)
        expected = reference_step(spans, query, k_blocks, v_blocks, block_varlen_args(spans, block_size))
        flash = FlashBlockTableAttention(spans, manager.block_views, block_size, device, kernel)
        out = flash(1, query, key, value, SCALE)
        torch.cuda.synchronize()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(sdpa.double(), expected, atol=tol, rtol=tol)
        del k_blocks, v_blocks, flash


@needs_bindings
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
@pytest.mark.parametrize("variant", ["window", "window+softcap", "sinks"])
def test_layer_variants_agree_across_flash_sdpa_and_triton(kv_backend, variant):
    """A sliding window (FlashAttention's window_size_left), soft-capping (the kernel's where it
    has it, else the explicit path) and sinks (the explicit path; Triton's own for decodes): every
    GPU path against the float64 reference, or, for sinks, the paths against each other."""
    from vmemkv.attention import BlockTableAttention, ContiguousAttention
    from vmemkv.attention.flash import FlashBlockTableAttention, FlashSlotAttention
    from vmemkv.attention.flash_args import block_varlen_args, flatten_slots, slot_geometry, slot_varlen_args

    paged = kv_backend == "paged"
    kernel = flash_kernel(paged)
    with cuda_manager(kv_backend, dtype=torch.float16) as manager:
        spans, query, key, value = mixed_step(manager, torch.float16, device="cuda")
        options = {"window": dict(window=6), "window+softcap": dict(window=6, softcap=0.7),
                   "sinks": dict(sinks=torch.linspace(-1.0, 2.0, query.shape[1], device="cuda"))}[variant]
        device = torch.device("cuda")
        if paged:
            size = manager.tokens_per_page
            views = manager.block_views
            flash = FlashBlockTableAttention(spans, views, size, device, kernel)
            sdpa = BlockTableAttention(spans, views, size, device)
            triton = BlockTableAttention(spans, views, size, device, decode_kernel=True)
            k_in, v_in = views(1)
            args = block_varlen_args(spans, size)
        else:
            rows = slot_geometry(*manager.kv_views(1))
            k_in, v_in = (flatten_slots(view, rows) for view in manager.kv_views(1))
            flash = FlashSlotAttention(spans, manager.kv_views, device, kernel, rows, k_in.shape[0])
            sdpa = ContiguousAttention(spans, manager.kv_views, device)
            triton = ContiguousAttention(spans, manager.kv_views, device, decode_kernel=True)
            args = slot_varlen_args(spans, rows, k_in.shape[0])
        outputs = [attention(1, query, key, value, SCALE, **options).double() for attention in (flash, sdpa, triton)]
        torch.cuda.synchronize()
        tol = TOLERANCE[torch.float16]
        if "sinks" in options:
            expected = outputs[1]
        else:
            expected = reference_step(spans, query, k_in, v_in, args, **options)
        for out in outputs:
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        del k_in, v_in, flash, sdpa, triton


@needs_bindings
@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_engine_with_flash_agrees_with_sdpa(kv_backend):
    """Greedy tokens of the flash engine and the SDPA engine, both float16: kernels round
    differently, so a near-tie may flip a late token; most must agree, every first token must."""
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.errors import ConfigError

    flash_kernel(paged=kv_backend == "paged")
    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 33, 48, 300))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens = {}
    for attention in ("flash", "sdpa"):
        extra = {"tokens_per_page": 256} if kv_backend == "paged" else {}
        config = EngineConfig(model="tiny-llama", device="cuda", dtype="float16", max_num_seqs=8,
                              max_model_len=512, max_num_batched_tokens=128, kv_backend=kv_backend,
                              attention=attention, **extra)
        try:
            engine = LLMEngine(config)
        except ConfigError as exc:  # the page chooser gave blocks FlashAttention-2 cannot read
            if "multiple of 256" in str(exc):
                pytest.skip(str(exc))
            raise
        try:
            if attention == "flash":
                assert engine.attention_kernel.startswith("flash-")
            final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
            tokens[attention] = [final[str(i)].outputs[0].token_ids for i in range(len(prompts))]
            engine.manager.check()
            assert engine.manager.num_blocks_in_use == 0
        finally:
            engine.close()
    same = sum(a == b for f, s in zip(tokens["flash"], tokens["sdpa"]) for a, b in zip(f, s))
    assert all(f[0] == s[0] for f, s in zip(tokens["flash"], tokens["sdpa"])), tokens
    assert same >= 0.9 * sum(len(t) for t in tokens["sdpa"]), tokens


def test_auto_picks_flash_for_half_precision_on_cuda():
    from vmemkv.attention.choice import choose_attention
    kernel = flash_kernel(paged=False)
    store = torch.zeros(4, 64, 2, 32, dtype=torch.float16, device="cuda")
    choice = choose_attention("auto", torch.device("cuda"), "vmem", torch.float16, 8, 2, 32, 16,
                              (store[:, :48], store[:, :48]))
    assert choice.kind == "flash" and choice.kernel.name == kernel.name and choice.rows_per_slot == 64
    fp32 = choose_attention("auto", torch.device("cuda"), "vmem", torch.float32, 8, 2, 32, 16,
                            (store.float(), store.float()))
    assert fp32.kind in ("triton", "sdpa") and "float16/bfloat16" in fp32.why_not_flash


def test_step_metadata_is_one_pinned_upload():
    from vmemkv.attention.metadata import StepMetadata
    staged = StepMetadata()
    staged.add("rows", [3, 1, 2])
    staged.add("table", [[1, 2], [3, 4]], torch.int32)
    tensors = staged.upload("cuda")
    assert staged.host.is_pinned()
    assert tensors["rows"].is_cuda and tensors["rows"].tolist() == [3, 1, 2]
    assert tensors["table"].dtype == torch.int32 and tensors["table"].tolist() == [[1, 2], [3, 4]]
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1


def test_package_kvcache_decode_with_cache_batch_idx():
    from vmemkv.attention.flash_kernels import package_features, package_kvcache_decode
    from vmemkv.attention.flash_reference import varlen_attention_reference
    features = package_features()
    if not features.available or not features.kvcache_batch_idx:
        pytest.skip(f"flash_attn with cache_batch_idx not installed ({features.reason})")
    generator = torch.Generator().manual_seed(0)
    cache_k = torch.randn(4, 64, 2, 64, generator=generator).half().cuda()
    cache_v = torch.randn(4, 64, 2, 64, generator=generator).half().cuda()
    q = torch.randn(3, 8, 64, generator=generator).half().cuda()
    slots, lengths = [3, 0, 2], [10, 64, 1]
    out = package_kvcache_decode(q, cache_k, cache_v, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                                 torch.tensor(slots, dtype=torch.int32, device="cuda"), max(lengths), SCALE)
    flat_k, flat_v = cache_k.flatten(0, 1), cache_v.flatten(0, 1)
    cu_k = torch.tensor([s * 64 for s in slots] + [256], dtype=torch.int32)
    expected = varlen_attention_reference(q, flat_k, flat_v, torch.arange(4, dtype=torch.int32), cu_k, SCALE,
                                          seqused_k=torch.tensor(lengths, dtype=torch.int32))
    torch.testing.assert_close(out.double(), expected, atol=4e-3, rtol=4e-3)
