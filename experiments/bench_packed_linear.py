"""A linear layer on the CPU: ``F.linear`` over the row-major weight against the same weight packed
once (``vmemkv.engine.models.packed_linear.PackedLinear``: panels for the native kernel in float32,
oneDNN's layout in bfloat16), at SmolLM2-135M's shapes
(hidden 576, MLP 1,536, vocabulary 49,152) for the row counts of decode steps and of a prefill
chunk. Microseconds per call, the 25th percentile of repeated calls on one input (the weight stays
in the caches where it fits: the MLP's does, the LM head's 113 MB does not).

    python experiments/bench_packed_linear.py --out experiments/results

``--fused``: instead, a decode layer's projections at SmolLM2-135M's shapes (q 576, k and v 192 (3 KV
heads of 64), MLP 1,536) in the order Hugging Face's Llama calls them, each packed alone against q|k|v
and gate|up as one GEMM each (``pack_linears(fuse=False)`` / ``pack_linears()``): the five that
fusion changes, and all seven (with o and down). Every pass runs ``--layers`` such layers (30, as the
model: their weights do not stay in the caches, as in a decode step); us per layer, the 25th
percentile of passes, the variants alternating.

    python experiments/bench_packed_linear.py --fused --out experiments/results

``--panels``: instead, the two float32 kernels over a whole model's linear layers, as a step reads
them: SmolLM2-135M's 30 decoder layers (seven projections each, packed alone) and its LM head, packed
for the native panel kernel and for oneDNN (``PackedLinear(kernel=...)``), the two alternating;
ms per pass (the median of ``--passes``), the weight bytes read per second, and oneDNN's time over
the panels'.

    python experiments/bench_packed_linear.py --panels --out experiments/results
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


class DecoderProjections(nn.Module):
    """The linear layers of one Llama decoder layer, called as its attention and MLP call them."""

    def __init__(self, hidden: int = 576, kv: int = 192, mlp: int = 1536):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n, bias=False) for n in (hidden, kv, kv))
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(hidden, mlp, bias=False), nn.Linear(hidden, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor, attended: torch.Tensor | None, hidden_mlp: torch.Tensor | None) -> None:
        """All seven; without ``attended`` and ``hidden_mlp``, only the five that fusion changes."""
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            projection(x)
        if attended is not None:
            self.o_proj(attended)
        self.gate_proj(x), self.up_proj(x)
        if hidden_mlp is not None:
            self.down_proj(hidden_mlp)


def bench_fused(args) -> tuple[list[dict], list[str]]:
    from vmemkv.engine.models.packed_linear import pack_linears

    rows = []
    with torch.inference_mode():
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            # Each model's layers made and packed one after the other (as the engine loads a model),
            # not copies of the other's: a copy's packed weights lie elsewhere in memory.
            models = {name: [DecoderProjections().to(dtype) for _ in range(args.layers)]
                      for name in ("separate", "fused")}
            models["separate"][0].load_state_dict(models["fused"][0].state_dict())  # for the difference
            for name, layers in models.items():
                for layer in layers:
                    pack_linears(layer, fuse=name == "fused")
            for m in [int(r) for r in args.rows.split(",")]:
                x, attended = torch.randn(1, m, 576).to(dtype), torch.randn(1, m, 576).to(dtype)
                hidden_mlp = torch.randn(1, m, 1536).to(dtype)
                times = {(name, part): [] for name in models for part in ("five", "layer")}
                for i in range(args.passes + 2):  # two warm-up passes; the variants alternate
                    for (name, part), kept in times.items():
                        inputs = (attended, hidden_mlp) if part == "layer" else (None, None)
                        start = time.perf_counter()
                        for layer in models[name]:
                            layer(x, *inputs)
                        if i >= 2:
                            kept.append((time.perf_counter() - start) / args.layers * 1e6)
                us = {key: sorted(t)[len(t) // 4] for key, t in times.items()}
                error = max(float((models["separate"][0].get_submodule(n)(x).float()
                                   - models["fused"][0].get_submodule(n)(x).float()).abs().max())
                            for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
                rows.append({"dtype": str(dtype).removeprefix("torch."), "rows": m,
                             **{f"{name}_{part}_us": value for (name, part), value in us.items()},
                             "max_abs_difference": error})
                print(rows[-1], flush=True)
    lines = ["| dtype | rows | q,k,v,gate,up separate us | fused us | saved | all seven separate us | fused us | "
             "saved | max abs difference |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'separate_{part}_us']:.0f} | {r[f'fused_{part}_us']:.0f} | "
                 f"{100 * (1 - r[f'fused_{part}_us'] / r[f'separate_{part}_us']):.0f}%" for part in ("five", "layer")]
        lines.append(f"| {r['dtype']} | {r['rows']} | {cells[0]} | {cells[1]} | {r['max_abs_difference']:.1e} |")
    return rows, lines


def bench_panels(args) -> tuple[list[dict], list[str]]:
    layers = {kernel: [] for kernel in ("panels", "onednn")}
    with torch.inference_mode():
        for i in range(args.layers + 1):  # the last: the LM head
            shapes = [(576, 49152)] if i == args.layers else [(576, 576), (576, 192), (576, 192), (576, 576),
                                                                  (576, 1536), (576, 1536), (1536, 576)]
            for k, n in shapes:
                linear = nn.Linear(k, n, bias=False)
                for kernel, kept in layers.items():
                    kept.append(PackedLinear(linear, kernel))
        weight_bytes = sum(layer.in_features * layer.out_features * 4 for layer in layers["panels"])
        rows = []
        for m in [int(r) for r in args.rows.split(",")]:
            inputs = {k: torch.randn(m, k) for k in (576, 1536)}
            times = {kernel: [] for kernel in layers}
            for i in range(args.passes + 1):  # one warm-up pass; the kernels alternate
                for kernel, kept in layers.items():
                    start = time.perf_counter()
                    for layer in kept:
                        layer(inputs[layer.in_features])
                    if i:
                        times[kernel].append(time.perf_counter() - start)
            ms = {kernel: sorted(t)[len(t) // 2] * 1e3 for kernel, t in times.items()}
            error = max(float((a(inputs[a.in_features]) - b(inputs[b.in_features])).abs().max())
                        for a, b in zip(layers["panels"][:7], layers["onednn"][:7]))
            rows.append({"rows": m, **{f"{kernel}_ms": v for kernel, v in ms.items()},
                         **{f"{kernel}_gb_per_s": weight_bytes / v / 1e6 for kernel, v in ms.items()},
                         "onednn_over_panels": ms["onednn"] / ms["panels"], "max_abs_difference": error})
            print(rows[-1], flush=True)
    lines = [f"{weight_bytes / 1e6:.0f} MB of float32 weights a pass", "",
             "| rows | panels ms | GB/s | oneDNN ms | GB/s | oneDNN / panels | max abs difference |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['panels_ms']:.1f} | {r['panels_gb_per_s']:.1f} | {r['onednn_ms']:.1f} | "
                     f"{r['onednn_gb_per_s']:.1f} | {r['onednn_over_panels']:.2f}x | {r['max_abs_difference']:.1e} |")
    return rows, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fused", action="store_true", help="a decode layer's projections, separate vs fused")
    parser.add_argument("--panels", action="store_true", help="a model's float32 linears, panels vs oneDNN")
    parser.add_argument("--layers", type=int, default=30, help="--fused, --panels: layers per pass")
    parser.add_argument("--passes", type=int, default=20, help="--fused, --panels: timed passes per variant")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="--fused: dtypes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from machine import cpu_model, write_results

    if args.fused or args.panels:
        default_rows = "1,4,16" if args.fused else "1,2,4,8,16,32,256,1024"
        args.rows = args.rows if args.rows != parser.get_default("rows") else default_rows
        rows, table = bench_fused(args) if args.fused else bench_panels(args)
        command = " ".join(["python experiments/bench_packed_linear.py", *sys.argv[1:]])
        load = os.getloadavg()[0]
        markdown = "\n".join([f"`{command}` ({cpu_model()}, {args.threads} thread(s), {args.layers} "
                              f"layers a pass, load average {load:.1f}): "
                              + ("us per decode layer, 25th percentile of passes" if args.fused else
                                 "ms per pass over every layer and the LM head, median of passes"),
                              "", *table]) + "\n"
        print(markdown)
        if args.out:
            stem = "packed_linear_fused_cpu" if args.fused else f"packed_linear_panels_{args.threads}t_cpu"
            write_results(args.out, stem, {"cpu": cpu_model(), "threads": args.threads,
                          "layers": args.layers, "load_average": load, "rows": rows}, markdown)
        return

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
