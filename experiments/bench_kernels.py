"""Decode-attention kernel time: vmem (virtually contiguous slots) vs paged (block table), GPU only.

The two Triton kernels of ``vmemkv.attention.triton_decode`` differ only in how they address a
key, so this isolates the cost of the block table. Llama-3-8B-like heads by default (32 q heads,
8 kv heads, head_dim 128, bf16), one decode token per sequence, every sequence at the full
context. Both kernels read the *same* token-major buffer ``[token][layer][k|v][kv_head][dim]``:
vmem as slots of ``context`` consecutive tokens, paged as ``block_size``-token blocks through a
shuffled block table (a pool after churn). Before timing, paged with an identity table is compared
with vmem on the same bytes (expected identical; exit status 1 if they differ by more than 1e-3). Times are ``triton.testing.do_bench`` medians (L2 flushed
between runs); GB/s counts the K and V bytes read.

    python experiments/bench_kernels.py                   # readable table
    python experiments/bench_kernels.py --json            # one JSON object
    python experiments/bench_kernels.py --out experiments/results   # kernels_gpu.md / .json

On a machine without a CUDA GPU it says so and exits 0 (with ``--json``: ``{"skipped": ...}``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

BATCH_SIZES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
AGREE_ATOL = 1e-3  # same bytes and tiles: expected 0 exactly; more than rounding noise is a bug


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure_one(batch: int, context: int, args, generator: torch.Generator) -> dict:
    import triton.testing

    from vmemkv.attention.triton_decode import (
        decode_attention_contiguous,
        decode_attention_paged,
        default_num_splits,
    )

    dtype = getattr(torch, args.dtype)
    kv_heads, head_dim, block_size, layers = args.kv_heads, args.head_dim, args.block_size, args.layers
    row = {"batch": batch, "context": context}
    if context % block_size:
        return {**row, "skipped": f"context {context} is not a multiple of block size {block_size}"}
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = batch * context
    token_elems = 2 * layers * kv_heads * head_dim
    buffer_bytes = tokens * token_elems * itemsize
    free, _ = torch.cuda.mem_get_info()
    if buffer_bytes > args.max_gib * 2**30 or buffer_bytes * 1.1 + (1 << 30) > free:
        return {**row, "skipped": f"buffer of {buffer_bytes / 2**30:.1f} GiB exceeds --max-gib {args.max_gib} "
                                  f"or free memory ({free / 2**30:.1f} GiB)"}

    buffer = torch.empty(tokens * token_elems, dtype=dtype, device="cuda")
    buffer.normal_(generator=generator)
    layer = layers - 1  # the last layer: the largest offset into each token's row
    k_offset, v_offset = (2 * layer) * kv_heads * head_dim, (2 * layer + 1) * kv_heads * head_dim
    slot_shape = (batch, context, kv_heads, head_dim)
    slot_strides = (context * token_elems, token_elems, head_dim, 1)
    k_slots = buffer.as_strided(slot_shape, slot_strides, k_offset)
    v_slots = buffer.as_strided(slot_shape, slot_strides, v_offset)
    num_blocks = tokens // block_size
    block_shape = (num_blocks, block_size, kv_heads, head_dim)
    block_strides = (block_size * token_elems, token_elems, head_dim, 1)
    k_blocks = buffer.as_strided(block_shape, block_strides, k_offset)
    v_blocks = buffer.as_strided(block_shape, block_strides, v_offset)

    q = torch.randn(batch, args.q_heads, head_dim, generator=generator, device="cuda").to(dtype)
    slot_ids = torch.arange(batch, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    identity = torch.arange(num_blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    shuffled = torch.randperm(num_blocks, generator=generator, device="cuda").to(torch.int32).view(batch, -1)
    scale = head_dim ** -0.5
    splits = args.num_splits or default_num_splits(batch, kv_heads, context, q.device)
    common = {"num_splits": splits, "max_seq_len": context}

    out_vmem, out_paged = torch.empty_like(q), torch.empty_like(q)
    decode_attention_contiguous(q, k_slots, v_slots, slot_ids, seq_lens, scale, out=out_vmem, **common)
    decode_attention_paged(q, k_blocks, v_blocks, identity, seq_lens, scale, out=out_paged, **common)
    torch.cuda.synchronize()
    max_diff = (out_vmem.float() - out_paged.float()).abs().max().item()

    def vmem():
        decode_attention_contiguous(q, k_slots, v_slots, slot_ids, seq_lens, scale, out=out_vmem, **common)

    def paged():
        decode_attention_paged(q, k_blocks, v_blocks, shuffled, seq_lens, scale, out=out_paged, **common)

    times = {}
    for name, fn in (("vmem", vmem), ("paged", paged)):
        median, low, high = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms,
                                                    quantiles=[0.5, 0.2, 0.8])
        times[name] = {"us": median * 1e3, "p20_us": low * 1e3, "p80_us": high * 1e3}
    kv_bytes = 2 * tokens * kv_heads * head_dim * itemsize
    del buffer
    torch.cuda.empty_cache()
    return {**row, "num_splits": splits, "kv_mib": kv_bytes / 2**20,
            "vmem_us": times["vmem"]["us"], "paged_us": times["paged"]["us"],
            "vmem_p20_p80_us": [times["vmem"]["p20_us"], times["vmem"]["p80_us"]],
            "paged_p20_p80_us": [times["paged"]["p20_us"], times["paged"]["p80_us"]],
            "paged_over_vmem": times["paged"]["us"] / times["vmem"]["us"],
            "vmem_gb_s": kv_bytes / times["vmem"]["us"] / 1e3,
            "paged_gb_s": kv_bytes / times["paged"]["us"] / 1e3,
            "agree": max_diff <= AGREE_ATOL, "max_abs_diff": max_diff}


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        "# Decode attention kernels: vmem vs paged (Triton)",
        "",
        (f"{result['device']}; torch {result['torch']}, triton {result['triton']}, {result['date']}. "
        f"{c['q_heads']} q heads, {c['kv_heads']} kv heads, head_dim {c['head_dim']}, {c['dtype']}; one decode "
        f"token per sequence, every sequence at the full context. Token-major buffer of {c['layers']} "
        f"layer(s) (token stride {c['token_stride_elems']} elements); paged: {c['block_size']}-token blocks, "
        "shuffled block table. Median µs of `triton.testing.do_bench` (L2 flushed); GB/s = K+V bytes read / time. "
        "Max abs diff: paged with an identity table against vmem on the same bytes (expected 0)."),
        "",
        "| batch | context | splits | K+V MiB | vmem µs | paged µs | paged / vmem | vmem GB/s | paged GB/s | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | – | – | – | – | – | – | – | skipped: {r['skipped']} |")
            continue
        lines.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | {r['kv_mib']:.0f} | "
                     f"{r['vmem_us']:.1f} | {r['paged_us']:.1f} | {r['paged_over_vmem']:.3f} | "
                     f"{r['vmem_gb_s']:.0f} | {r['paged_gb_s']:.0f} | {r['max_abs_diff']:.2g}"
                     f"{'' if r['agree'] else ' (DISAGREE)'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int_list, default=list(BATCH_SIZES))
    parser.add_argument("--contexts", type=int_list, default=list(CONTEXTS))
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers interleaved per token in the buffer (memory grows with it)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of the paged view")
    parser.add_argument("--num-splits", type=int, default=None, help="split-K factor (default: heuristic)")
    parser.add_argument("--max-gib", type=float, default=48.0, help="skip configurations whose buffer is larger")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="write kernels_gpu.md and kernels_gpu.json here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured"
        print(f"bench_kernels: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": reason}))
        return 0
    try:
        import triton
    except ImportError as exc:
        reason = f"needs Triton ({exc}); nothing measured"
        print(f"bench_kernels: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": reason}))
        return 0

    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            row = measure_one(batch, context, args, generator)
            rows.append(row)
            if "skipped" in row:
                print(f"batch {batch:4d} context {context:5d}: skipped ({row['skipped']})", file=sys.stderr)
            else:
                print(f"batch {batch:4d} context {context:5d} splits {row['num_splits']:2d}: vmem "
                      f"{row['vmem_us']:8.1f} µs, paged {row['paged_us']:8.1f} µs "
                      f"(x{row['paged_over_vmem']:.3f}), agree {row['agree']}", file=sys.stderr)
    result = {
        "benchmark": "bench_kernels",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "config": {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "dtype": args.dtype, "layers": args.layers, "block_size": args.block_size,
                   "token_stride_elems": 2 * args.layers * args.kv_heads * args.head_dim,
                   "num_splits": args.num_splits, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms},
        "rows": rows,
    }
    table = markdown(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "kernels_gpu.md").write_text(table)
    print(json.dumps(result) if args.json else table)
    disagree = [r for r in rows if "agree" in r and not r["agree"]]
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
