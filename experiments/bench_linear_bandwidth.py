"""How close a decode step's linears come to the memory bandwidth: SmolLM2-135M's linear weights
(30 layers of q, k, v, o, gate, up, down, and the LM head), packed for oneDNN as the engine packs
them, multiplied by ``--rows`` rows, against a plain read of as many bytes (torch's float32 sum,
which streams at the memory's pace). A decode step reads every weight once: at a few rows the
linears should run at the read's speed.

    python experiments/bench_linear_bandwidth.py --dtype bfloat16 --rows 4 --threads 1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_attention import median_ms  # noqa: E402

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
          (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [(VOCAB, HIDDEN)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype), None) for n, k in SHAPES]
    inputs = {k: torch.randn(args.rows, 1, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    nbytes = sum(n * k for n, k in SHAPES) * dtype.itemsize
    stream = torch.randn(nbytes // 4)

    def linears():
        for (_, k), weight in zip(SHAPES, weights):
            torch.ops.mkldnn._linear_pointwise(inputs[k], weight, None, "none", [], "")

    print(f"SmolLM2-135M's linears, {args.dtype}, {args.rows} rows, {nbytes / 1e6:.0f} MB of weights\n")
    print("| threads | linears ms | linears GB/s | plain read GB/s |\n|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        linear_s, read_s = median_ms(linears, 15) / 1e3, median_ms(stream.sum, 15) / 1e3
        print(f"| {threads} | {linear_s * 1e3:.1f} | {nbytes / linear_s / 1e9:.1f} | {nbytes / read_s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
