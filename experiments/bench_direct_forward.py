"""A decode step with a Llama model run by direct calls of its modules (``EngineConfig.direct_forward``,
the default) against the model's own transformers forward: the Python around the modules.

Two engines on the same model (``--model``, ``--dtype``), one per setting, each with ``--requests``
requests of ``--prompt-tokens`` seeded random token ids computed; then ``--rounds`` rounds decode
``--steps`` steps at each thread count of ``--threads`` on each engine in turn (the order rotating
each round, so drift of the shared host hits both alike). Reported per thread count: each
setting's median step milliseconds, the difference, and the ratio. Both engines decode the same
greedy tokens (checked: the run stops if they differ).

    python experiments/bench_direct_forward.py                       # readable table
    python experiments/bench_direct_forward.py --out experiments/results   # direct_forward_cpu.md/.json
    python experiments/bench_direct_forward.py --quick               # smoke run, tiny model
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

SETTINGS = {"direct calls": True, "transformers forward": False}


def start_engine(direct: bool, args) -> LLMEngine:
    """An engine with every prompt computed (each request has its first token)."""
    headroom = args.rounds * args.steps * len(args.threads) + 64
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", threads=max(args.threads),
        max_num_seqs=args.requests, max_model_len=args.prompt_tokens + headroom,
        enable_prefix_caching=False, direct_forward=direct))
    rng = random.Random(args.seed)
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 250
    params = SamplingParams(max_tokens=headroom, temperature=0, ignore_eos=True)
    for index in range(args.requests):
        engine.add_request(f"r{index}", [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)], params)
    started = set()
    while len(started) < args.requests:
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    return engine


def measure(engine: LLMEngine, threads: int, steps: int, times: list[float]) -> dict[str, list[int]]:
    """``steps`` decode steps at ``threads`` threads; returns each request's tokens so far."""
    torch.set_num_threads(threads)
    tokens = {}
    for _ in range(steps):
        began = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - began)
        tokens.update({out.request_id: list(out.outputs[0].token_ids) for out in outputs})
    return tokens


def step_times(args) -> tuple[list[dict], dict[str, str]]:
    engines = {name: start_engine(direct, args) for name, direct in SETTINGS.items()}
    said = {name: engine.direct_forward for name, engine in engines.items()}
    times = {name: {t: [] for t in args.threads} for name in engines}
    order = list(engines)
    for round_ in range(args.rounds):
        for threads in args.threads:
            tokens = {name: measure(engines[name], threads, args.steps, times[name][threads])
                      for name in order[round_ % 2:] + order[:round_ % 2]}
            if len({repr(sorted(t.items())) for t in tokens.values()}) != 1:
                raise RuntimeError("the two engines decoded different tokens")
    for engine in engines.values():
        engine.close()
    rows = []
    for threads in args.threads:
        direct, forward = (statistics.median(times[name][threads]) * 1e3 for name in SETTINGS)
        rows.append({"threads": threads, "direct_ms": direct, "forward_ms": forward,
                     "saved_ms": forward - direct, "speedup": forward / direct})
    return rows, said


def markdown(results: dict) -> str:
    args = results["args"]
    lines = [f"`{results['command']}` — {results['cpu']} ({results['flags']}); {args['model']} in {args['dtype']}, "
             f"{args['requests']} requests of {args['prompt_tokens']:,} prompt tokens decoding; step median over "
             f"{args['rounds']} x {args['steps']} steps per setting and thread count (taking turns), load before "
             f"{results['load_before']:.2f}; {results['said']['direct calls']}", "",
             "| threads | direct calls, ms | transformers forward, ms | saved, ms | speed-up |",
             "|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        lines.append(f"| {row['threads']} | {row['direct_ms']:.2f} | {row['forward_ms']:.2f} | "
                     f"{row['saved_ms']:.2f} | {row['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_bench_arguments(parser, "direct_forward_cpu", prompt_tokens=64, rounds=8, steps=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.dtype, args.rounds, args.steps = "tiny-llama", "float32", 2, 3
    load_before = os.getloadavg()[0]
    rows, said = step_times(args)
    return finish_bench("bench_direct_forward.py", argv, args,
                        {"load_before": load_before, "said": said, "rows": rows}, markdown)


if __name__ == "__main__":
    sys.exit(main())
