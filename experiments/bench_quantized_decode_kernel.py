"""The native decode routine alone over bfloat16, int8 and fp8 rows, laid out as the engine lays them.

Per KV dtype, one buffer ``[B, T, layers, k|v, row]`` where a row is a layer's K (or V) values of
every kv head and, quantized, their float32 scales right after them, padded as the layout pads
them (the token-major layout of ``memory/layout.py``: a token's layers one after another, so a
layer's rows of consecutive tokens lie a whole token apart; a quantized row of 216 bytes is padded
to 224, so a layer's K and V fill whole cache lines; ``--unpadded`` leaves them at 216). Random
rows (``quantized_rows.quantize`` for int8 / fp8), a bfloat16 query, SmolLM2-135M's heads (9 query,
3 kv, head_dim 64). Timed per dtype, one torch thread:

* ``memory``: one call per layer over ``--layers`` layers (4 x 7,500 tokens x 30 layers by
  default: the rows come from DRAM, as in a decode step);
* ``cache``: one layer of ``--cache-tokens`` tokens called ``--layers`` times (about 3.5 MB of int8
  rows: from L3), the arithmetic without the memory.

The dtypes take turns within each repeat, so drift of the shared host hits all alike; the median
of the repeats is reported. The step-level number is ``bench_quantized_kv.py``'s; this one says
where a kernel change lands.

    python experiments/bench_quantized_decode_kernel.py
    python experiments/bench_quantized_decode_kernel.py --out experiments/results   # quantized_decode_kernel_cpu.md/.json
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from vmemkv.attention.cpu_decode import decode_attention_contiguous_cpu
from vmemkv.memory.layout import padded_row_bytes
from vmemkv.memory.quantized_rows import groups_per_row, quantize
from machine import cpu_flags_note, cpu_model, write_results  # experiments/machine.py

DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def cache_layers(dtype: torch.dtype, batch: int, tokens: int, layers: int, generator,
                 padded: bool = True) -> list[tuple]:
    """Per layer, (k, v, scales or None): views into one token-major buffer, rows filled at random."""
    groups = groups_per_row(HEAD_DIM)
    values = KV_HEADS * HEAD_DIM * dtype.itemsize
    row = values + (KV_HEADS * groups * 4 if dtype != torch.bfloat16 else 0)
    buffer = torch.zeros(batch, tokens, layers, 2, padded_row_bytes(row, dtype) if padded else row,
                         dtype=torch.uint8)
    out = []
    for layer in range(layers):
        views = []
        for kv in range(2):
            rows = torch.randn(batch, tokens, KV_HEADS, HEAD_DIM, generator=generator)
            value_view = buffer[:, :, layer, kv, :values].view(dtype).unflatten(-1, (KV_HEADS, HEAD_DIM))
            if dtype == torch.bfloat16:
                value_view.copy_(rows.bfloat16())
                views.append((value_view, None))
                continue
            quantized, scales = quantize(rows, dtype)
            scale_view = buffer[:, :, layer, kv, values:row].view(torch.float32).unflatten(-1, (KV_HEADS, groups))
            value_view.copy_(quantized)
            scale_view.copy_(scales)
            views.append((value_view, scale_view))
        (k, k_scales), (v, v_scales) = views
        out.append((k, v, None if k_scales is None else (k_scales, v_scales)))
    return out


def timed(layers: list[tuple], calls: int, q, lens) -> float:
    slots = torch.arange(q.shape[0])
    began = time.perf_counter()
    for index in range(calls):
        k, v, scales = layers[index % len(layers)]
        decode_attention_contiguous_cpu(q, k, v, slots, lens, HEAD_DIM ** -0.5, kv_scales=scales)
    return (time.perf_counter() - began) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=7500)
    parser.add_argument("--cache-tokens", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--unpadded", action="store_true",
                        help="also time the quantized rows unpadded (216 bytes, as before the layout padded them)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    kinds = {name: (DTYPES[name], True) for name in args.dtypes}
    if args.unpadded:
        kinds.update({f"{name} unpadded": (DTYPES[name], False) for name in args.dtypes if name != "bf16"})
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, generator=generator).bfloat16()
    runs = {}
    for name, (dtype, padded) in kinds.items():
        runs[(name, "memory")] = (cache_layers(dtype, args.batch, args.tokens, args.layers, generator, padded),
                                  torch.full((args.batch,), args.tokens, dtype=torch.int32))
        runs[(name, "cache")] = (cache_layers(dtype, args.batch, args.cache_tokens, 1, generator, padded),
                                 torch.full((args.batch,), args.cache_tokens, dtype=torch.int32))
    times = {key: [] for key in runs}
    for repeat in range(args.repeats + 1):  # the first repeat warms up and is dropped
        for key, (layers, lens) in runs.items():
            elapsed = timed(layers, args.layers, q, lens)
            if repeat:
                times[key].append(elapsed)
    lines = [f"`python experiments/bench_quantized_decode_kernel.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
             f" ({datetime.date.today().isoformat()}; {cpu_model()}, {cpu_flags_note()}; one thread; median of "
             f"{args.repeats}): {args.layers} calls, {args.batch} sequences of {args.tokens:,} tokens (memory) or "
             f"{args.cache_tokens:,} (cache), SmolLM2-135M's heads", "",
             "| KV rows | from memory, ms | vs bf16 | from cache, ms | vs bf16 |", "|---|---:|---:|---:|---:|"]
    medians = {key: statistics.median(v) for key, v in times.items()}
    for name in kinds:
        base = {where: medians.get(("bf16", where)) for where in ("memory", "cache")}
        cells = []
        for where in ("memory", "cache"):
            ms = medians[(name, where)]
            cells += [f"{ms:.1f}", f"{base[where] / ms:.2f}x" if base[where] else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        results = {"args": {**vars(args), "out": str(args.out)}, "cpu": cpu_model(), "flags": cpu_flags_note(),
                   "ms": {f"{name}/{where}": v for (name, where), v in times.items()}}
        write_results(args.out, "quantized_decode_kernel_cpu", results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
