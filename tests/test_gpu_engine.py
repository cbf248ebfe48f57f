"""The manager and the engine on a real GPU: CUDA VMM pages under the same code as on CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import cuda_bindings_missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

skip_without_bindings = pytest.mark.skipif(cuda_bindings_missing(),
                                           reason="needs cuda-python (pip install cuda-bindings)")


@skip_without_bindings
def test_manager_on_cuda_keeps_data_through_fork_and_swap():
    from vmemkv import CacheConfig, KVCacheManager

    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=32, max_num_seqs=4,
                         max_model_len=512, dtype=torch.bfloat16, device="cuda",
                         swap_space_bytes=64 << 20)
    with KVCacheManager(config) as manager:
        prompt = list(range(1, 41))
        assert manager.admit("a", prompt) == 0
        slot = manager.slot_of("a")
        values = torch.arange(40 * 2 * 64, device="cuda", dtype=torch.float32).view(40, 2, 64)
        for layer in range(4):
            k, v = manager.kv_views(layer)
            k[slot, :40] = (values + layer).to(torch.bfloat16)
            v[slot, :40] = (-values - layer).to(torch.bfloat16)
        manager.commit("a")
        assert manager.fork("a", "b")
        manager.preempt("a", "swap")
        assert manager.swap_in("a")
        manager.check()
        for request in ("a", "b"):
            slot = manager.slot_of(request)
            for layer in range(4):
                k, v = manager.kv_views(layer)
                torch.testing.assert_close(k[slot, :40].float(), (values + layer).to(torch.bfloat16).float())
                torch.testing.assert_close(v[slot, :40].float(), (-values - layer).to(torch.bfloat16).float())
        manager.free("a")
        manager.free("b")
        manager.check()
        assert manager.num_blocks_in_use == 0


@skip_without_bindings
@pytest.mark.parametrize("kv_backend,attention", [("vmem", "sdpa"), ("vmem", "triton"),
                                                   ("paged", "triton")])
def test_engine_on_cuda_matches_hf_generate(kv_backend, attention):
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.engine.models.zoo import load_model

    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 33, 48))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model="tiny-llama", device="cuda", max_num_seqs=8,
                                    max_model_len=256, kv_backend=kv_backend, attention=attention))
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
    reference, _ = load_model("tiny-llama", device="cuda")
    reference.set_attn_implementation("sdpa")
    for i, prompt in enumerate(prompts):
        expected = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                                      min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert final[str(i)].outputs[0].token_ids == expected[0, len(prompt):].tolist()
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0
    engine.close()


@skip_without_bindings
def test_sleep_on_cuda_moves_the_weights_to_host_and_wake_up_restores_the_same_tokens():
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion

    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((9, 40))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model="tiny-llama", device="cuda", max_num_seqs=4, max_model_len=128),
                       stream=False)

    def generate(tag):
        final = run_to_completion(engine, [(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
        return [final[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]

    before = generate("a")
    model = engine.runner.model_runner.model
    allocated = torch.cuda.memory_allocated()
    assert engine.sleep(1) > 0  # every KV page goes back (cuMemRelease), the cached ones too
    assert engine.manager.memories[0].backend.resident_bytes() == 0
    # the weights go to host memory: the device's allocation falls
    assert all(param.numel() == 0 for param in model.parameters())
    assert torch.cuda.memory_allocated() < allocated
    engine.wake_up()
    assert next(model.parameters()).device.type == "cuda"
    assert generate("b") == before
    engine.sleep(2)  # dropped, then loaded again by name
    engine.wake_up()
    assert generate("c") == before
    engine.close()


def latent_rows_survive_fork_and_swap(device: str) -> None:
    """An MLA manager's latent rows (one row of 576 values per token per layer, DeepSeek-V3's width)
    on ``device`` pages: a request's rows of a layer are one strided view of its slot, and read
    back bit-exact after a fork and a swap out and in."""
    from vmemkv import CacheConfig, KVCacheManager

    config = CacheConfig(num_layers=3, num_kv_heads=1, head_dim=576, num_blocks=16, max_num_seqs=4,
                         max_model_len=512, dtype=torch.bfloat16, device=device, latent=True,
                         swap_space_bytes=64 << 20)
    with KVCacheManager(config) as manager:
        assert manager.layout.kv_bytes_per_token_per_layer == 1152
        assert manager.admit("a", list(range(1, 41))) == 0
        rows = torch.randn(3, 40, 576, device=device).to(torch.bfloat16)
        for layer in range(3):
            k, v = manager.kv_views(layer)
            assert v.data_ptr() == k.data_ptr()  # the latent row is K and V
            view = k[manager.slot_of("a"), :40, 0]
            assert view.stride() == (manager.layout.token_stride, 1)  # no block table
            view.copy_(rows[layer])
        del k, v, view  # no view may outlive the manager
        manager.commit("a")
        assert manager.fork("a", "b")
        manager.preempt("a", "swap")
        assert manager.swap_in("a")
        manager.check()
        for request in ("a", "b"):
            for layer in range(3):
                assert torch.equal(manager.kv_views(layer)[0][manager.slot_of(request), :40, 0], rows[layer])
        manager.free("a")
        manager.free("b")
        assert manager.num_blocks_in_use == 0


@skip_without_bindings
def test_mla_latent_rows_on_cuda_pages_survive_fork_and_swap():
    latent_rows_survive_fork_and_swap("cuda")


@skip_without_bindings
@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-minicpm3"])
def test_mla_engine_on_cuda_matches_hf_generate(model):
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.core.llm_engine import run_to_completion
    from vmemkv.engine.models.zoo import load_model

    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 33, 48))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=model, device="cuda", max_num_seqs=8, max_model_len=256,
                                    max_num_batched_tokens=32))
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(prompts)])
    reference, _ = load_model(model, device="cuda")
    for i, prompt in enumerate(prompts):  # </s> neither stops nor is suppressed, as ignore_eos
        expected = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        assert final[str(i)].outputs[0].token_ids == expected[0, len(prompt):].tolist()
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0
    engine.close()
