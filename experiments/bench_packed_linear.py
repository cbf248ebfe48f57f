"""A linear layer on the CPU: ``F.linear`` over the row-major weight against oneDNN over the same
weight packed once (``vmemkv.engine.models.packed_linear.PackedLinear``), at SmolLM2-135M's shapes
(hidden 576, MLP 1,536, vocabulary 49,152) for the row counts of decode steps and of a prefill
chunk. Microseconds per call, the 25th percentile of repeated calls on one input (the weight stays
in the caches where it fits: the MLP's does, the LM head's 113 MB does not).

    python experiments/bench_packed_linear.py --out experiments/results
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vmemkv.engine.models.packed_linear import PackedLinear

HERE = Path(__file__).resolve().parent
SHAPES = {"attention projection": (576, 576), "MLP up": (576, 1536), "LM head": (576, 49152)}


def timed(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from machine import cpu_model, write_results

    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for name, (k, n) in SHAPES.items():
                linear = nn.Linear(k, n, bias=False).to(dtype)
                packed = PackedLinear(linear)
                for m in [int(r) for r in args.rows.split(",")]:
                    x = torch.randn(m, k).to(dtype)
                    calls = 30 if n > 10_000 else 200
                    plain = timed(lambda: F.linear(x, linear.weight), calls)
                    fast = timed(lambda: packed(x), calls)
                    error = float((packed(x).float() - F.linear(x, linear.weight).float()).abs().max())
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "layer": name, "in": k, "out": n,
                                 "rows": m, "f_linear_us": plain, "packed_us": fast, "speedup": plain / fast,
                                 "max_abs_difference": error})
                    print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    lines = [f"`python experiments/bench_packed_linear.py --out experiments/results` ({cpu_model()}, "
             f"{args.threads} thread(s), load average {load:.1f}): us per call, 25th percentile", "",
             "| dtype | layer | in x out | rows | F.linear us | packed us | speedup | max abs difference |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['layer']} | {r['in']} x {r['out']} | {r['rows']} | {r['f_linear_us']:.0f} | "
                     f"{r['packed_us']:.0f} | {r['speedup']:.2f}x | {r['max_abs_difference']:.1e} |")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if args.out:
        write_results(args.out, "packed_linear_cpu", {"cpu": cpu_model(), "threads": args.threads,
                                                      "load_average": load, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
