"""KV held per request on a sliding-window model: blocks released behind the window
(``CacheConfig.sliding_window``) against keeping every block, on vmem slots and on the block-table
baseline (the same manager, so it frees out-of-window blocks the same way, as vLLM's hybrid
manager does).

Two parts:

* ``manager``: long generations driven through the manager alone, as the engine drives it (the
  prompt prefilled in chunks of ``--chunk`` tokens, then one ``allocate`` + ``commit`` per token,
  with the engine's one-token lookahead block). Shape: a tiny Mistral's KV (2 layers, 2 KV heads
  of dim 32, fp16: 512 B a token, 16-token blocks of 8 KiB), a ``--prompt-len`` 128 prompt,
  ``--new-tokens`` 4,096 new tokens, window ``--window`` 512. Reports the peak blocks one request
  holds, and how many requests fit in a pool of ``--pool-blocks`` blocks: ``fit`` requests run in
  lockstep (all at their peak at once) to the end with no refusal, and ``fit + 1`` are refused
  somewhere on the way (both checked by running them).
* ``engine``: the engine on a random-weight tiny Mistral (2 layers, hidden 64, window
  ``--engine-window`` 128, 16-token blocks), ``--engine-requests`` 6 requests of 32 prompt +
  ``--engine-new-tokens`` 768 new tokens in a pool of ``--engine-pool-blocks`` 64 blocks: with
  release they all run at once; keeping every block, one at a time fits. Reports wall time,
  tokens/s, the most requests running at once and the peak blocks per running request; the
  greedy tokens of every configuration must be equal.

Released blocks are counted over the ``fit`` requests' run.

* ``hybrid`` (local and global layers: a ``KVCacheManager`` of two layer groups,
  ``layer_windows``), on vmem slots and on block
  tables: the manager alone on a Gemma-3-like shape (5 local layers of window ``--window`` to 1
  global, 2 KV heads of dim 32, fp16), one request of the same length: the peak bytes it holds in
  each group against keeping every block, and the requests that fit ``--pool-blocks`` blocks'
  bytes. Then the engine on a random-weight tiny Gemma-2 (one local layer of window
  ``--engine-window``, one global), ``--engine-requests`` requests of 32 + ``--engine-new-tokens``
  tokens in ``--hybrid-pool-blocks`` blocks of both layers (prefill chunks of 64 tokens): layout
  groups with release against one group keeping every block (``EngineConfig.
  release_behind_window=False``, the CLI's ``--keep-blocks-behind-window``), greedy tokens equal
  across all four.

    python experiments/bench_window.py                  # readable tables
    python experiments/bench_window.py --json           # one JSON object
    python experiments/bench_window.py --out experiments/results   # window_cpu.md / .json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vmemkv import CacheConfig, KVCacheManager, KVRequest  # noqa: E402

from machine import cpu_model, write_results  # experiments/machine.py, beside this script  # noqa: E402

MODES = [("vmem", True), ("vmem", False), ("paged", True), ("paged", False)]  # (kv_backend, release)
GROUPS_LABEL = {True: "local + global", False: "one (keep every block)"}


# --- the manager alone ---------------------------------------------------------------------------------
def manager_for(kv_backend: str, release: bool, args, num_seqs: int) -> KVCacheManager:
    return KVCacheManager(CacheConfig(
        num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_page=16,
        num_blocks=args.pool_blocks, max_num_seqs=num_seqs,
        max_model_len=args.prompt_len + args.new_tokens, kv_backend=kv_backend,
        sliding_window=args.window if release else None, hash_seed=b"bench-window"))


def run_lockstep(m: KVCacheManager, num_requests: int, args) -> tuple[bool, int]:
    """``num_requests`` generations side by side, as the engine runs them; returns (whether every
    step was granted, the peak blocks held by one request)."""
    reqs = [KVRequest(f"r{i}", [(7 * i + j) % 200 + 1 for j in range(args.prompt_len)])
            for i in range(num_requests)]
    peak = 0
    try:
        for req in reqs:  # chunked prefill, one chunk a step
            if m.admit(req, token_budget=args.chunk) is None:
                return False, peak
            m.commit(req)
            while req.num_tokens < args.prompt_len:
                if not m.allocate(req, min(args.chunk, args.prompt_len - req.num_tokens)):
                    return False, peak
                m.commit(req)
        for step in range(args.new_tokens):
            m.map_lookahead(m.allocate_lookahead(reqs, 1))
            for req in reqs:
                req.token_ids.append(step % 200 + 1)
                if not m.allocate(req, 1):
                    return False, peak
                m.commit(req)
            peak = max(peak, max(len(req.block_table) - req.num_released_blocks for req in reqs))
        return True, peak
    finally:
        for req in reqs:
            m.discard(req)


def manager_part(args) -> list[dict]:
    rows = []
    for kv_backend, release in MODES:
        m = manager_for(kv_backend, release, args, 1)
        began = time.perf_counter()
        ok, peak = run_lockstep(m, 1, args)
        seconds = time.perf_counter() - began
        m.close()
        assert ok, "one request must fit the pool"
        fit = args.pool_blocks // peak
        fits, released = {}, {}
        for count in (fit, fit + 1):
            m = manager_for(kv_backend, release, args, count)
            fits[count], _ = run_lockstep(m, count, args)
            released[count] = m.cache_stats().blocks_released_behind_window
            m.check()
            m.close()
        window_blocks = -(-args.window // 16)
        rows.append({
            "kv_backend": kv_backend, "release": release, "peak_blocks_per_request": peak,
            "peak_kv_bytes_per_request": peak * 16 * 512,
            "window_blocks": window_blocks, "within_window_plus_2": peak <= window_blocks + 2,
            "requests_that_fit": fit, "fit_ran": fits[fit], "one_more_refused": not fits[fit + 1],
            "blocks_released_behind_window": released[fit], "seconds_one_request": round(seconds, 2)})
    return rows


# --- the engine ------------------------------------------------------------------------------------
def tiny_mistral(window: int):
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=4096, bos_token_id=256, eos_token_id=None,
                           pad_token_id=0, sliding_window=window)
    return AutoModelForCausalLM.from_config(config).eval()


def engine_run(kv_backend: str, release: bool, args) -> dict:
    from vmemkv.engine import EngineConfig, LLMEngine
    from vmemkv.engine.models.zoo import byte_tokenizer

    class Config(EngineConfig):
        def cache_config(self, model):  # keeping every block: the manager without the window
            cache = super().cache_config(model)
            return cache if release else dataclasses.replace(cache, sliding_window=None)

    config = Config(max_num_seqs=args.engine_requests, max_model_len=32 + args.engine_new_tokens,
                    tokens_per_page=16, num_blocks=args.engine_pool_blocks, kv_backend=kv_backend,
                    watermark=0.0)
    engine = LLMEngine(config, model=tiny_mistral(args.engine_window), tokenizer=byte_tokenizer())
    assert engine.manager.tokens_per_page == 16
    row = drive(engine, args, lambda: engine.manager.num_blocks_in_use, "peak_blocks_per_running_request")
    return {"kv_backend": kv_backend, "release": release, **row}


def drive(engine, args, held, peak_name: str) -> dict:
    """Run ``--engine-requests`` greedy requests of 32 + ``--engine-new-tokens`` tokens to the
    end; ``held()``: what the KV cache holds now (blocks or bytes), reported per running request
    at its peak as ``peak_name``. Closes the engine."""
    from vmemkv.engine import SamplingParams

    params = SamplingParams(max_tokens=args.engine_new_tokens, temperature=0, ignore_eos=True)
    for i in range(args.engine_requests):
        engine.add_request(str(i), [(13 * i + j) % 250 + 1 for j in range(32)], params)
    most_running, peak_per_request, outputs = 0, 0, {}
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        running = len(engine.scheduler.running)
        most_running = max(most_running, running)
        if running:
            peak_per_request = max(peak_per_request, held() / running)
    seconds = time.perf_counter() - began
    stats = engine.manager.cache_stats()
    engine.close()
    tokens = args.engine_requests * args.engine_new_tokens
    return {"seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 1),
            "most_running": most_running, peak_name: round(peak_per_request, 1),
            "preemptions": stats.preemptions_swap + stats.preemptions_recompute,
            "blocks_released_behind_window": stats.blocks_released_behind_window,
            "tokens": [outputs[str(i)] for i in range(args.engine_requests)]}



def engine_part(args) -> list[dict]:
    rows = [engine_run(kv_backend, release, args) for kv_backend, release in MODES]
    reference = rows[0]["tokens"]
    for row in rows:
        row["same_tokens"] = row.pop("tokens") == reference
    return rows


# --- local and global layers -------------------------------------------------------------------
HYBRID_WINDOWS = [1] * 5 + [None]  # five local layers to one global (the window is set per run)


def hybrid_manager_part(args) -> list[dict]:
    """One request through the manager of two layer groups and through one group keeping every
    block, on each KV backend (grouped: the two groups, the local one releasing behind the
    window)."""
    return [hybrid_manager_run(kv_backend, grouped, args) for kv_backend, grouped in MODES]


def hybrid_manager_run(kv_backend: str, grouped: bool, args) -> dict:
    windows = [args.window if w else None for w in HYBRID_WINDOWS]
    config = CacheConfig(num_layers=len(windows), num_kv_heads=2, head_dim=32, dtype=torch.float16,
                         tokens_per_page=16, num_blocks=args.pool_blocks, max_num_seqs=1,
                         max_model_len=args.prompt_len + args.new_tokens, kv_backend=kv_backend,
                         hash_seed=b"bench-window")
    m = (KVCacheManager(config, layer_windows=windows, chunk_tokens=args.chunk) if grouped
         else KVCacheManager(config))
    groups = m.layout_groups
    assert len(groups) == (2 if grouped else 1)
    req = KVRequest("r", [(7 * j) % 200 + 1 for j in range(args.prompt_len)])
    assert m.admit(req, token_budget=args.chunk) is not None
    m.commit(req)
    while req.num_tokens < args.prompt_len:
        assert m.allocate(req, min(args.chunk, args.prompt_len - req.num_tokens))
        m.commit(req)
    peak_bytes, peak_local = 0, 0
    for step in range(args.new_tokens):
        req.token_ids.append(step % 200 + 1)
        assert m.allocate(req, 1)
        m.commit(req)
        peak_bytes = max(peak_bytes, m.kv_bytes_in_use)  # every pool's blocks held, once each
        if grouped:
            peak_local = max(peak_local, len(req.group_block_table(1)) - req.group_released_blocks(1))
    released = m.cache_stats().blocks_released_behind_window
    budget = args.pool_blocks * config.make_layout().block_bytes
    m.check()
    m.free(req)
    m.close()
    window_blocks = -(-args.window // 16)
    return {
        "kv_backend": kv_backend, "layout_groups": GROUPS_LABEL[grouped],
        "peak_kv_bytes_per_request": peak_bytes,
        "peak_local_blocks": peak_local if grouped else "-",
        "local_within_window_plus_2": peak_local <= window_blocks + 2 if grouped else "-",
        "requests_that_fit_by_bytes": budget // peak_bytes,
        "blocks_released_behind_window": released}


def tiny_gemma2(window: int):
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          query_pre_attn_scalar=32, max_position_embeddings=4096, bos_token_id=256,
                          eos_token_id=None, pad_token_id=0, sliding_window=window)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("eager")
    return model


def hybrid_engine_run(kv_backend: str, grouped: bool, args) -> dict:
    from vmemkv.engine import EngineConfig, LLMEngine
    from vmemkv.engine.models.zoo import byte_tokenizer

    # prefill chunks of 64 tokens: the local group is sized for the window and one step's chunk;
    # release_behind_window=False: one group keeping every block
    config = EngineConfig(max_num_seqs=args.engine_requests, max_model_len=32 + args.engine_new_tokens,
                          tokens_per_page=16, num_blocks=args.hybrid_pool_blocks, watermark=0.0,
                          max_num_batched_tokens=64, kv_backend=kv_backend,
                          release_behind_window=grouped)
    engine = LLMEngine(config, model=tiny_gemma2(args.engine_window), tokenizer=byte_tokenizer())
    m = engine.manager
    groups = m.layout_groups
    assert len(groups) == (2 if grouped else 1), [group.spec for group in groups]
    row = drive(engine, args, lambda: engine.manager.kv_bytes_in_use,
                "peak_kv_bytes_per_running_request")
    return {"kv_backend": kv_backend, "layout_groups": GROUPS_LABEL[grouped], **row}


def hybrid_engine_part(args) -> list[dict]:
    rows = [hybrid_engine_run(kv_backend, grouped, args) for kv_backend, grouped in MODES]
    reference = rows[1]["tokens"]  # vmem, one group keeping every block
    for row in rows:
        row["same_tokens"] = row.pop("tokens") == reference
    return rows


# --- output --------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--pool-blocks", type=int, default=1024)
    parser.add_argument("--engine-window", type=int, default=128)
    parser.add_argument("--engine-new-tokens", type=int, default=768)
    parser.add_argument("--engine-requests", type=int, default=6)
    parser.add_argument("--engine-pool-blocks", type=int, default=64)
    parser.add_argument("--hybrid-pool-blocks", type=int, default=160)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, help="write window_cpu.md and window_cpu.json here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": cpu_model(), "python": platform.python_version(),
                           "torch": torch.__version__},
               "args": vars(args) | {"out": str(args.out) if args.out else None},
               "manager": manager_part(args)}
    results["hybrid_manager"] = hybrid_manager_part(args)
    if not args.skip_engine:
        results["engine"] = engine_part(args)
        results["hybrid_engine"] = hybrid_engine_part(args)
    text = (f"## Manager: {args.prompt_len} + {args.new_tokens} tokens, window {args.window}, "
            f"16-token blocks, pool of {args.pool_blocks} blocks\n\n{table(results['manager'])}\n")
    if "engine" in results:
        text += (f"\n## Engine: tiny Mistral, window {args.engine_window}, {args.engine_requests} "
                 f"requests of 32 + {args.engine_new_tokens} tokens, pool of "
                 f"{args.engine_pool_blocks} blocks\n\n{table(results['engine'])}\n")
    text += (f"\n## Hybrid manager: 5 local layers (window {args.window}) to 1 global, "
             f"{args.prompt_len} + {args.new_tokens} tokens, the bytes of {args.pool_blocks} blocks\n\n"
             f"{table(results['hybrid_manager'])}\n")
    if "hybrid_engine" in results:
        text += (f"\n## Hybrid engine: tiny Gemma-2 (1 local layer, window {args.engine_window}, "
                 f"1 global), {args.engine_requests} requests of 32 + {args.engine_new_tokens} tokens, "
                 f"pool of {args.hybrid_pool_blocks} blocks (vmem slots and block tables)\n\n{table(results['hybrid_engine'])}\n")
    if args.out:
        write_results(args.out, "window_cpu", results, text)
    print(json.dumps(results) if args.json else text)
    return results


if __name__ == "__main__":
    main()
