"""Long-context decode with quantized live KV (``kv_cache_dtype`` int8 / fp8) against the model's
own bfloat16 KV: where reading the KV outweighs reading the weights, half the bytes a token.

Per KV dtype, one engine (SmolLM2-135M-Instruct in bfloat16, ``--requests`` requests of
``--prompt-tokens`` seeded random token ids each, no shared prefix) computes the prompts at
``--prefill-threads`` threads; then ``--rounds`` rounds decode ``--steps`` steps at each thread
count of ``--threads`` on each engine in turn (all engines alive, their order rotating each round,
so drift of the shared host hits every dtype and thread count alike). Reported per dtype: the KV
bytes a token holds per layer and in all, and the seconds the prompts took; per dtype and thread
count: the decode step's median milliseconds, its attention's share (the engine's attention
timer), and the step time relative to bfloat16 KV's.

    python experiments/bench_quantized_kv.py                         # readable table
    python experiments/bench_quantized_kv.py --out experiments/results   # quantized_kv_decode_cpu.md/.json
    python experiments/bench_quantized_kv.py --quick                 # smoke run, tiny model
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from machine import add_decode_bench_arguments, finish_bench  # experiments/machine.py

KV_DTYPES = ("auto", "int8", "fp8")


def start_engine(kv_cache_dtype: str, args) -> tuple[LLMEngine, float]:
    """An engine on ``kv_cache_dtype`` with every prompt computed, and the seconds that took."""
    # The first prompts decode while the later ones are computed in chunks: room for those tokens
    # too (measure() says if a measured step decoded fewer than all requests).
    headroom = args.rounds * args.steps * len(args.threads) + 512
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", threads=args.prefill_threads,
        kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.requests,
        max_model_len=args.prompt_tokens + headroom, enable_prefix_caching=False))
    rng = random.Random(args.seed)
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 250
    params = SamplingParams(max_tokens=headroom, temperature=0, ignore_eos=True)
    for index in range(args.requests):
        engine.add_request(f"r{index}", [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)], params)
    start, started = time.perf_counter(), set()
    while len(started) < args.requests:  # every prompt computed: each has its first token
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    return engine, time.perf_counter() - start


def measure(engine: LLMEngine, threads: int, args, steps: list[float], attention: list[float]) -> None:
    """``args.steps`` decode steps at ``threads`` threads: each step's seconds, and its attention's."""
    torch.set_num_threads(threads)
    for _ in range(args.steps):
        before = engine.attention_seconds
        began = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - began)
        if len(outputs) != args.requests:
            raise RuntimeError(f"a measured step decoded {len(outputs)} of {args.requests} requests: "
                               f"{[(o.request_id, len(o.outputs[0].token_ids)) for o in outputs]}, "
                               f"{ {k: engine.stats()[k] for k in ('running', 'waiting', 'preemptions')} }")
        attention.append(engine.attention_seconds - before)


def decode_times(args) -> list[dict]:
    """Per KV dtype, its row: every engine started first, then each round measures each thread
    count on every engine in turn (the engines' order rotating), so drift of the shared host
    hits every dtype alike."""
    engines = {kv: start_engine(kv, args) for kv in args.kv_dtypes}
    steps = {kv: {t: [] for t in args.threads} for kv in engines}
    attention = {kv: {t: [] for t in args.threads} for kv in engines}
    order = list(engines)
    for round_ in range(args.rounds):
        for threads in args.threads:
            for kv in order[round_ % len(order):] + order[:round_ % len(order)]:
                measure(engines[kv][0], threads, args, steps[kv][threads], attention[kv][threads])
    rows = []
    for kv, (engine, prefill_seconds) in engines.items():
        layout = engine.manager.layout
        rows.append({
            "kv_cache_dtype": kv, "kv_dtype": str(layout.dtype).removeprefix("torch."),
            "kv_bytes_per_token_per_layer": layout.kv_bytes_per_token_per_layer,
            "kv_bytes_per_token": layout.token_bytes, "prefill_seconds": prefill_seconds,
            "step_ms": {t: statistics.median(v) * 1e3 for t, v in steps[kv].items()},
            "attention_ms": {t: statistics.median(v) * 1e3 for t, v in attention[kv].items()},
        })
        engine.close()
    return rows


def markdown(results: dict) -> str:
    args = results["args"]
    lines = [f"`{results['command']}` — {results['cpu']} ({results['flags']}); {args['requests']} requests of "
             f"{args['prompt_tokens']:,} prompt tokens, {args['model']} in {args['dtype']}; decode step median "
             f"over {args['rounds']} x {args['steps']} steps per thread count (thread counts and KV dtypes "
             f"taking turns), "
             f"load before {results['load_before']:.2f}", "",
             "| KV dtype | B/token/layer | prompts s | threads | step ms | attention ms | step vs bf16 KV |",
             "|---|---|---|---|---|---|---|"]
    rows = results["rows"]
    base = next(r for r in rows if r["kv_cache_dtype"] == "auto")
    for row in rows:
        name = "auto (" + row["kv_dtype"] + ")" if row["kv_cache_dtype"] == "auto" else row["kv_cache_dtype"]
        for threads in args["threads"]:
            step = row["step_ms"][threads]
            lines.append(f"| {name} | {row['kv_bytes_per_token_per_layer']:,} | {row['prefill_seconds']:.1f} | "
                         f"{threads} | {step:.1f} | "
                         f"{row['attention_ms'][threads]:.1f} | {base['step_ms'][threads] / step:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_bench_arguments(parser, "quantized_kv_decode_cpu", prompt_tokens=7500, rounds=6, steps=8)
    parser.add_argument("--prefill-threads", type=int, default=2)
    parser.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.dtype, args.prompt_tokens, args.rounds, args.steps = "tiny-llama", "float32", 300, 1, 3
    load_before = os.getloadavg()[0]
    return finish_bench("bench_quantized_kv.py", argv, args, {"load_before": load_before, "rows": decode_times(args)},
                        markdown)


if __name__ == "__main__":
    sys.exit(main())
