"""Shared-prefix (cascade) decoding on and off, in one process: two engines on the same model and
prompts, alternating runs, the native CPU decode routine either way (``shared_prefix_decode``).

The workloads are ``bench_vs_vllm``'s with a shared prefix: ``long-context`` (4 prompts after one
~1,500-token text, cached by a warm-up) and ``shared-prefix`` (32 questions after one ~700-token
system prompt). Reported per workload: output tokens per second, the engine's milliseconds per
step and of them in the attention calls (``attention_seconds``: K/V writes + the decode routine),
and whether the greedy tokens of the two engines are identical. This VM moves a run by ±10 %:
the per-step attention time is the steadier number.

    python experiments/bench_shared_prefix.py --threads 2 --repeats 3 --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench_vs_vllm import make_workloads, warm_up  # experiments/bench_vs_vllm.py, beside this script
from machine import cpu_model, write_results  # experiments/machine.py
from vmemkv.engine import LLM, SamplingParams
from vmemkv.engine.models.hub import ensure_real_model

MODEL = "smollm2-135m-instruct"


def timed_run(llm: LLM, requests: list) -> dict:
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    attention_before, seconds_before, steps_before = engine.attention_seconds, engine.step_seconds, engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    steps = max(engine.num_steps - steps_before, 1)
    return {"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
            "step_ms": (engine.step_seconds - seconds_before) / steps * 1e3,
            "attention_ms": (engine.attention_seconds - attention_before) / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine (alternating)")
    parser.add_argument("--workloads", default="long-context,shared-prefix")
    parser.add_argument("--kv-backend", default="vmem", choices=["vmem", "paged"])
    parser.add_argument("--out", type=Path, help="write <stem>.md and .json here")
    parser.add_argument("--stem", default=None, help="default shared_prefix_<backend>_<threads>t_cpu")
    args = parser.parse_args()

    ensure_real_model(MODEL)
    load_before = os.getloadavg()[0]
    engines = {share: LLM(MODEL, threads=args.threads, max_model_len=2048, max_num_seqs=32,
                          attention="native", kv_backend=args.kv_backend, shared_prefix_decode=share)
               for share in (False, True)}
    workloads = make_workloads(engines[True].tokenizer)
    rows = []
    for name in args.workloads.split(","):
        requests = workloads[name]
        for llm in engines.values():
            llm.generate([ids for ids, _ in warm_up(name, requests)],
                         [SamplingParams(temperature=0.0, max_tokens=n) for _, n in warm_up(name, requests)],
                         use_tqdm=False)
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for share, llm in engines.items():
                runs[share].append(timed_run(llm, requests))
        off, on = runs[False], runs[True]
        row = {"workload": name, "threads": args.threads, "kv_backend": args.kv_backend,
               "off_tok_s": statistics.median(r["tok_s"] for r in off),
               "on_tok_s": statistics.median(r["tok_s"] for r in on),
               **{f"{label}_{key}": statistics.median(r[key] for r in runs_)
                  for label, runs_ in (("off", off), ("on", on)) for key in ("step_ms", "attention_ms")},
               "identical": all(a["tokens"] == b["tokens"] for a, b in zip(off, on)),
               "off_runs_tok_s": [r["tok_s"] for r in off], "on_runs_tok_s": [r["tok_s"] for r in on]}
        row["speedup"] = row["on_tok_s"] / row["off_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    load_after = os.getloadavg()[0]
    command = (f"python experiments/bench_shared_prefix.py --threads {args.threads} --repeats {args.repeats} "
               f"--workloads {args.workloads} --kv-backend {args.kv_backend}")
    lines = [f"`{command}` — torch {torch.__version__}, load {load_before:.2f} before, {load_after:.2f} after; "
             f"{cpu_model()}; medians of {args.repeats} alternating runs", "",
             "| workload | backend | threads | tok/s off | tok/s on | on / off | ms/step off / on "
             "| of which attention off / on | greedy identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['kv_backend']} | {r['threads']} | {r['off_tok_s']:.1f} | "
                     f"{r['on_tok_s']:.1f} | {r['speedup']:.2f} | {r['off_step_ms']:.1f} / {r['on_step_ms']:.1f} | "
                     f"{r['off_attention_ms']:.1f} / {r['on_attention_ms']:.1f} | {r['identical']} |")
    print("\n".join(lines))
    if args.out:
        stem = args.stem or f"shared_prefix_{args.kv_backend}_{args.threads}t_cpu"
        write_results(args.out, stem, {"command": command, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
