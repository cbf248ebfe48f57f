"""The engine's greedy tokens equal Hugging Face ``generate`` on the same weights, token for token,
under batching, prefix hits, preemption (swap and recompute), chunked prefill and n > 1, on two
architectures. After every test the cache's invariants hold and no page is held."""

from __future__ import annotations

import functools

import pytest
import torch

from vmemkv.engine import LLMEngine, EngineConfig, SamplingParams
from vmemkv.engine.core.llm_engine import run_to_completion
from vmemkv.engine.models.zoo import load_model
from vmemkv.errors import RequestTooLongError

NEW_TOKENS = 12


@functools.cache
def reference_model(name: str):
    model, _ = load_model(name, seed=0)
    model.set_attn_implementation("sdpa")
    return model


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
    model = reference_model(name)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(count: int, lengths=(5, 17, 33, 40, 9, 64, 23, 48), offset: int = 0) -> list[list[int]]:
    return [[(31 * (i + offset) + 7 * j) % 250 + 1 for j in range(lengths[i % len(lengths)])]
            for i in range(count)]


def make_engine(model: str = "tiny-llama", **overrides) -> LLMEngine:
    config = dict(model=model, max_num_seqs=8, max_model_len=256, swap_space_bytes=64 << 20)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=n)


def run(engine: LLMEngine, token_prompts, params=None) -> list:
    params = params or greedy()
    final = run_to_completion(engine, [(str(i), p, params) for i, p in enumerate(token_prompts)])
    return [final[str(i)] for i in range(len(token_prompts))]


def assert_clean(engine: LLMEngine) -> None:
    engine.manager.check()
    assert engine.manager.num_blocks_in_use == 0, "pages leaked"
    assert not engine.has_unfinished_requests()


def assert_matches_hf(model: str, token_prompts, outputs) -> None:
    for prompt, output in zip(token_prompts, outputs):
        expected = hf_greedy(model, tuple(prompt))
        for completion in output.outputs:
            assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_single_request_matches_hf(model):
    engine = make_engine(model)
    batch = prompts(1)
    assert_matches_hf(model, batch, run(engine, batch))
    assert_clean(engine)


@pytest.mark.parametrize("model,kv_backend", [("tiny-llama", "vmem"), ("tiny-qwen2", "vmem"),
                                              ("tiny-llama", "paged"), ("tiny-qwen2", "paged")])
def test_ragged_batch_matches_hf(model, kv_backend):
    engine = make_engine(model, kv_backend=kv_backend)
    batch = prompts(8)
    assert_matches_hf(model, batch, run(engine, batch))
    assert_clean(engine)


@pytest.mark.parametrize("kv_backend", ["vmem", "paged"])
def test_prefix_hits_match_hf(kv_backend):
    engine = make_engine(kv_backend=kv_backend)
    system = prompts(1, lengths=(40,), offset=5)[0]
    batch = [system + tail for tail in prompts(4, lengths=(3, 11, 20, 7))]
    first = run(engine, batch[:1])
    rest = run(engine, batch[1:])
    assert all(output.num_cached_tokens == 32 for output in rest)  # two full 16-token pages
    assert engine.manager.cache_stats().prefix_hit_tokens >= 3 * 32
    assert_matches_hf("tiny-llama", batch, first + rest)
    assert_clean(engine)


@pytest.mark.parametrize("mode,kv_backend", [("swap", "vmem"), ("recompute", "vmem"),
                                             ("swap", "paged")])
def test_preemption_matches_hf(mode, kv_backend):
    # 12 pages of 16 tokens for 6 sequences that each grow to ~3-4 pages: someone must wait.
    engine = make_engine(num_blocks=12, preemption_mode=mode, enable_prefix_caching=False,
                         watermark=0.0, kv_backend=kv_backend)
    batch = prompts(6, lengths=(30, 35, 40, 28, 33, 38))
    outputs = run(engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    stats = engine.manager.cache_stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt), 20)
    assert_clean(engine)


@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
def test_chunked_prefill_matches_hf(layout):
    engine = make_engine(max_num_batched_tokens=24, layout=layout)
    batch = prompts(4, lengths=(64, 50, 9, 33))
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)


def test_parallel_sampling_greedy_forks_match_hf():
    engine = make_engine()
    batch = prompts(2, lengths=(37, 21))
    outputs = run(engine, batch, greedy(n=3))
    assert all(len(output.outputs) == 3 for output in outputs)
    assert engine.manager.cache_stats().forks == 4  # two requests, two forks each
    assert_matches_hf("tiny-llama", batch, outputs)
    assert_clean(engine)


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    batch = prompts(3)
    first = run(make_engine(), batch, params)
    engine = make_engine()
    # Same seeds in a different batch composition must draw the same tokens.
    second = run(engine, batch[::-1] + prompts(2, offset=9), params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second[:3][::-1]]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) > 1
    assert_clean(engine)


def test_too_long_prompt_fails_alone():
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        engine.add_request("long", list(range(1, 65)), greedy())
    batch = prompts(2, lengths=(10, 20))
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)


def test_prompt_larger_than_pool_fails_alone():
    engine = make_engine(num_blocks=4)
    with pytest.raises(RequestTooLongError, match="pool"):
        engine.add_request("huge", list(range(1, 100)), greedy())
    assert_clean(engine)


def test_request_outgrowing_pool_fails_alone_others_finish():
    # 4 pages hold 64 tokens; asking for 80 tokens after a 20-token prompt cannot fit.
    engine = make_engine(num_blocks=4, enable_prefix_caching=False, watermark=0.0)
    engine.add_request("big", prompts(1, lengths=(20,))[0],
                       SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    final = run_to_completion(engine, [])
    assert final["big"].outputs[0].finish_reason == "error"
    assert "pool" in final["big"].error
    batch = prompts(1, lengths=(10,))
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)


def test_abort_frees_pages():
    engine = make_engine()
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.manager.num_blocks_in_use > 0
    engine.abort_request("a")
    assert_clean(engine)


@pytest.mark.parametrize("lookahead,overlap", [(0, False), (1, False), (5, False), (1, True), (5, True)])
def test_overlapped_mapping_matches_hf(lookahead, overlap):
    """Lookahead blocks mapped on the worker during the forward (overlap, the GPU's way), or at
    once on the step thread (the CPU default): the same tokens either way."""
    engine = make_engine(lookahead_tokens=lookahead)
    assert engine.runner.overlap_mapping is False  # CPU: no worker
    engine.runner.overlap_mapping = overlap
    batch = prompts(4, lengths=(14, 15, 30, 47))  # all cross page boundaries while decoding
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    stats = engine.stats()
    if lookahead:
        assert stats["map_background_seconds"] > 0
    else:
        assert stats["map_background_seconds"] == 0
    if not overlap:  # mapped on the step thread: nothing hidden, and no worker was started
        assert stats["map_hidden_seconds"] == 0
        assert engine.runner.lookahead is None or engine.runner.lookahead._worker is None
    assert_clean(engine)


def test_offline_text_is_decoded_once_and_matches_full_decode():
    from vmemkv import LLM

    llm = LLM("tiny-llama", max_num_seqs=4, max_model_len=128)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, stop=["e"])]
    outputs = llm.generate(["Hello world", "héllo 🙂"], params, use_tqdm=False)
    plain, stopped = outputs[0].outputs[0], outputs[1].outputs[0]
    assert plain.text == llm.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    if stopped.stop_reason == "e":  # stop strings still cut the text
        assert "e" not in stopped.text
    assert_clean(llm.engine)


@pytest.mark.parametrize("lookahead", [4, 16, 64, 1000])
def test_lookahead_up_to_and_past_max_model_len_matches_hf(lookahead):
    # Both requests run to max_model_len (4 pages of 16 tokens); the lookahead of the one in the
    # first slot must never reach the second slot's pages, nor the last slot past the range.
    engine = make_engine(max_model_len=64, max_num_seqs=2, lookahead_tokens=lookahead)
    batch = prompts(2, lengths=(40, 33))
    outputs = run(engine, batch, SamplingParams(max_tokens=31, temperature=0, ignore_eos=True))
    for prompt, output in zip(batch, outputs):
        new = min(31, 64 - len(prompt))
        assert output.outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt), new)
    assert_clean(engine)


def test_a_refused_lookahead_mapping_costs_only_the_head_start():
    from vmemkv.errors import MappingLimitError

    engine = make_engine(lookahead_tokens=8)
    refusals = []

    def refused(jobs):  # as if the mapping budget had no room on the worker
        refusals.append(len(jobs))
        raise MappingLimitError("no mapping to spare (test)")

    engine.manager.map_lookahead = refused
    batch = prompts(4, lengths=(14, 15, 30, 47))
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert refusals, "no lookahead was tried"
    assert_clean(engine)


def test_aborting_a_request_preempted_by_recompute_leaves_nothing_behind():
    engine = make_engine(num_blocks=12, preemption_mode="recompute", enable_prefix_caching=False,
                         watermark=0.0)
    for i, prompt in enumerate(prompts(6, lengths=(30, 35, 40, 28, 33, 38))):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while not engine.scheduler.num_preemptions:
        engine.step()
    preempted = [seq.request_id for seq in engine.scheduler.waiting if seq.num_computed == 0
                 and seq.output_token_ids]
    assert preempted, "the preempted request waits to be recomputed"
    for request_id in preempted:
        engine.abort_request(request_id)
    run_to_completion(engine, [])
    assert not engine.manager.registry.preempted, "the manager still remembers aborted requests"
    assert_clean(engine)


@pytest.mark.parametrize("bad", [[1.5, 2.0, 3.0], [1, None], [1, 10 ** 6], [-1, 2], ["a", "b"]])
def test_bad_token_ids_are_refused_at_add_request_and_the_engine_runs_on(bad):
    from vmemkv.errors import InvalidInputError

    engine = make_engine()
    with pytest.raises(InvalidInputError, match="prompt"):
        engine.add_request("bad", bad, greedy())
    batch = prompts(1, lengths=(10,))
    assert_matches_hf("tiny-llama", batch, run(engine, batch))
    assert_clean(engine)


@pytest.mark.parametrize("spare", [3, 8])
def test_mapping_pressure_preempts_and_everyone_still_matches_hf(spare):
    # Few kernel mappings to spare: growing requests are refused by the mapping budget, which
    # the scheduler treats like a short pool (preempt, then reclaim the freed slots' mappings).
    engine = make_engine(enable_prefix_caching=False, lookahead_tokens=0)
    backend = engine.manager.backend
    backend.max_mappings = backend.mappings_in_use + spare
    batch = prompts(6, lengths=(14, 15, 30, 47, 20, 9))
    outputs = run(engine, batch, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs):
        assert output.error is None
        assert output.outputs[0].token_ids == hf_greedy("tiny-llama", tuple(prompt), 20)
    assert_clean(engine)


# --- max_model_len against the model's own limit (vLLM's _get_and_verify_max_len) ---------------

def test_max_model_len_past_the_models_limit_is_refused_naming_the_limit_and_the_override():
    from vmemkv import LLM
    from vmemkv.errors import ConfigError

    with pytest.raises(ConfigError, match=r"limit of 32768 tokens \(max_position_embeddings=32768.*"
                                          r"allow_long_max_model_len=True"):
        LLM("tiny-llama", max_model_len=40000, max_num_seqs=2, threads=1)


def test_the_override_runs_past_the_models_limit(caplog):
    from vmemkv import LLM

    llm = LLM("tiny-llama", max_model_len=40000, allow_long_max_model_len=True, max_num_seqs=1, threads=1)
    assert llm.engine.config.max_model_len == 40000
    assert "limit of 32768 tokens" in caplog.text
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_max_model_len_defaults_to_the_models_limit_at_most_1024():
    from types import SimpleNamespace

    from vmemkv.engine.core.config import DEFAULT_MAX_MODEL_LEN

    assert DEFAULT_MAX_MODEL_LEN == 1024
    short, long = (SimpleNamespace(max_position_embeddings=n) for n in (512, 8192))
    assert EngineConfig().for_model(short).max_model_len == 512
    assert EngineConfig().for_model(long).max_model_len == 1024
    assert EngineConfig().for_model(SimpleNamespace()).max_model_len == 1024  # no limit named
    assert EngineConfig(max_model_len=300).for_model(short).max_model_len == 300


@pytest.mark.parametrize("config,limit", [
    (dict(max_position_embeddings=8192), 8192),
    (dict(n_positions=1024, max_position_embeddings=2048), 1024),  # the smallest key
    (dict(max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0}), 16384),
    (dict(max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), 131072),
    (dict(max_position_embeddings=131072, rope_parameters={  # already the scaled length
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}), 131072),
    (dict(max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5}), 8192),
])
def test_the_models_limit_is_read_as_vllm_reads_it(config, limit):
    from types import SimpleNamespace

    from vmemkv.engine.models.hf_support import model_length_limit

    assert model_length_limit(SimpleNamespace(**config))[0] == limit


# --- max_tokens past max_model_len: refused as vLLM's server refuses it ---------------------------

def test_llm_refuses_max_tokens_past_max_model_len_before_anything_runs():
    from vmemkv import LLM

    llm = LLM("tiny-llama", max_num_seqs=4, max_model_len=64, threads=1)
    batch = prompts(2, lengths=(10, 20))
    with pytest.raises(RequestTooLongError, match=r"maximum context length is 64 tokens\. However, "
                                                  r"you requested 120 tokens \(20 in the messages, "
                                                  r"100 in the completion\)"):
        llm.generate(batch, [greedy(), SamplingParams(max_tokens=100)], use_tqdm=False)
    with pytest.raises(RequestTooLongError, match="max_model_len"):  # a too-long prompt, the same way
        llm.generate([batch[0], list(range(1, 65))], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # neither call added its first request
    assert_matches_hf("tiny-llama", batch, llm.generate(batch, greedy(), use_tqdm=False))
    assert_clean(llm.engine)


def test_a_refused_request_leaves_a_running_one_alone():
    engine = make_engine(max_model_len=64)
    running = prompts(1, lengths=(30,))[0]
    engine.add_request("running", running, greedy())
    engine.step()
    with pytest.raises(RequestTooLongError, match="30 in the messages, 35 in the completion"):
        engine.check_request("refused", running, SamplingParams(max_tokens=35))
    final = run_to_completion(engine, [])
    assert final["running"].outputs[0].token_ids == hf_greedy("tiny-llama", tuple(running))
    assert_clean(engine)
