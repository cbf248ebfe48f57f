"""What the engine's kernel choice sees on this CPU (``vmemkv/engine/models/kernel_choice.py``), and
what the CPU engine's allocator settings change (``vmemkv/engine/core/host_malloc.py``).

1. *kernels*: SmolLM2-135M's first linear layers (twice the last-level cache, as the engine times
   them) packed for the native panels (T0 and non-temporal prefetches) and oneDNN; ms per pass at
   each row count (``time_kernels``: the best of ``--repeats`` alternating passes), and which the
   engine's rule (least total over 16 + 256 rows) takes.
2. *page faults*: a fresh engine process per variant (the settings are process-wide) prefills
   2 x 2,048 tokens (16 prompts of 256) and reports each step's seconds, minor page faults and
   system time, with and without ``keep_freed_memory``.

    python experiments/bench_kernel_choice.py --threads 2 --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import cpu_model, write_results  # noqa: E402

MODEL = "smollm2-135m-instruct"


def kernels(rows: list[int], repeats: int) -> dict:
    from vmemkv.engine.models.kernel_choice import ROWS, choose_kernel, label, last_level_cache_bytes, time_kernels
    from vmemkv.engine.models.zoo import load_model

    model = load_model(MODEL, torch.float32, "cpu", 0)[0]
    table = {count: {label(*c): s for c, s in time_kernels(model, rows=(count,), repeats=repeats).items()}
             for count in rows}
    kernel, hint, why = choose_kernel(model)
    return {"rows": table, "chosen": label(kernel, hint), "why": why, "rule_rows": list(ROWS),
            "last_level_cache_mb": last_level_cache_bytes() / 2**20}


def prefill_steps(threads: int, keep: bool) -> list[dict]:
    """Run in a fresh process: two 2,048-token prefill steps."""
    import vmemkv.engine.core.llm_engine as llm_engine
    from vmemkv.engine import LLM, SamplingParams

    if not keep:
        llm_engine.keep_freed_memory = lambda: False
    engine = LLM(MODEL, max_model_len=2048, max_num_seqs=16, threads=threads).engine
    generator = torch.Generator().manual_seed(0)
    for i in range(16):
        engine.add_request(str(i), torch.randint(100, 40000, (256,), generator=generator).tolist(),
                           SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    steps = []
    for _ in range(2):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        engine.step()
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"seconds": seconds, "minor_faults": after.ru_minflt - before.ru_minflt,
                      "system_s": after.ru_stime - before.ru_stime})
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fault-runs", type=int, default=2, help="processes per allocator variant")
    parser.add_argument("--prefill-worker", choices=["keep", "default"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.prefill_worker:
        print(json.dumps(prefill_steps(args.threads, args.prefill_worker == "keep")))
        return
    load = os.getloadavg()[0]
    results = {"cpu": cpu_model(), "threads": args.threads, "load_before": load, "kernels": kernels(args.rows, args.repeats)}
    faults = {"keep": [], "default": []}
    for _ in range(args.fault_runs):  # alternating variants
        for variant in faults:
            out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--prefill-worker", variant],
                                 capture_output=True, text=True, check=True).stdout
            faults[variant].append(json.loads(out.strip().splitlines()[-1]))
    results["prefill_faults"] = faults
    results["load_after"] = os.getloadavg()[0]
    kern = results["kernels"]
    names = list(next(iter(kern["rows"].values())))
    lines = [f"# Packed-linear kernels and the allocator on this CPU ({results['cpu']})", "",
             f"`python experiments/bench_kernel_choice.py --threads {args.threads}` (load average {load:.1f} before, "
             f"{results['load_after']:.1f} after; last-level cache {kern['last_level_cache_mb']:.0f} MB).", "",
             "ms per pass over SmolLM2-135M's first linears (twice the last-level cache):", "",
             "| rows | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    lines += [f"| {rows} | " + " | ".join(f"{1e3 * s:.1f}" for s in table.values()) + " |"
              for rows, table in kern["rows"].items()]
    lines += ["", f"The engine's rule ({' + '.join(map(str, kern['rule_rows']))} rows) takes **{kern['chosen']}**: "
              f"{kern['why']}.", "", "Two 2,048-token prefill steps in a fresh process (16 prompts of 256 tokens):", "",
              "| allocator | run | step | seconds | minor page faults | system s |", "|---|---:|---:|---:|---:|---:|"]
    for variant, runs in faults.items():
        label = "glibc defaults" if variant == "default" else "keep_freed_memory"
        lines += [f"| {label} | {run} | {step} | {s['seconds']:.2f} | {s['minor_faults']:,} | {s['system_s']:.2f} |"
                  for run, steps in enumerate(runs, 1) for step, s in enumerate(steps, 1)]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if args.out:
        write_results(args.out, f"kernel_choice_{args.threads}t_cpu", results, markdown)


if __name__ == "__main__":
    main()
