"""Engine throughput against torch's intra-op threads, on a quiet machine and beside busy
processes: what ``EngineConfig.threads``' default (the usable cores less one,
``vmemkv/engine/core/threads.py``) is chosen from.

Each run starts a fresh ``LLM`` with ``threads=t`` and generates greedily for a batch of short
prompts, while ``hogs`` other processes spin on the CPU (0: quiet). Wall-clock tokens per second,
the median of ``--repeats`` runs.

    python experiments/bench_threads.py                       # the table
    python experiments/bench_threads.py --out experiments/results   # threads_cpu.md / .json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, write_results  # noqa: E402


def spin(stop) -> None:
    while not stop.is_set():
        pass


def run_once(model: str, threads: int, prompts: int, tokens: int) -> float:
    from vmemkv.engine import SamplingParams
    from vmemkv.engine.core.llm import LLM

    llm = LLM(model=model, threads=threads, max_num_seqs=prompts, max_model_len=256)
    texts = [f"Tell me about the number {i} in one sentence." for i in range(prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(texts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.engine.close()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows, load_before = [], os.getloadavg()[0]
    for hogs in args.hogs:
        stop = multiprocessing.Event()
        busy = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(hogs)]
        for process in busy:
            process.start()
        try:
            for threads in args.threads:
                rates = [run_once(args.model, threads, args.prompts, args.tokens) for _ in range(args.repeats)]
                rows.append({"hogs": hogs, "threads": threads, "tokens_per_s": statistics.median(rates),
                             "runs": rates})
                print(f"hogs {hogs} threads {threads}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            stop.set()
            for process in busy:
                process.join()
    result = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "model": args.model,
              "load_average_1min_before": load_before,
              "prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats, "rows": rows}
    lines = [f"# Engine throughput against torch threads ({args.model}, {args.prompts} prompts x "
             f"{args.tokens} tokens, {result['cores']} cores)", "",
             "`python experiments/bench_threads.py --out experiments/results`; busy processes spin "
             "beside the engine; median of "
             f"{args.repeats} runs.", "", "| busy processes | threads | tokens/s |", "|---:|---:|---:|"]
    lines += [f"| {r['hogs']} | {r['threads']} | {r['tokens_per_s']:.1f} |" for r in rows]
    if args.out:
        write_results(args.out, "threads_cpu", result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
