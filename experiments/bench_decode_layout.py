"""One layer's batched decode attention, per KV layout: what each addressing costs to read.

For each model shape and layout (``token_major``: ``[token][layer][k|v][head][dim]``;
``per_layer``: vAttention's, each layer's K and V its own virtual tensor), a real
``KVCacheManager`` holds ``B`` requests in slots ``0..B-1`` with random cached lengths, and one
layer's attention call (write the new tokens, then attend) is timed for:

* ``vmem``: one SDPA call over the zero-copy strided view of the slot run (filler pages past the
  shorter requests, length mask) — the engine's CPU decode path;
* ``vmem-per-seq``: one SDPA call per sequence over its slot view;
* ``paged``: the block-table baseline at its best, its blocks gathered into one padded tensor
  (a copy) and one SDPA call;
* ``vmem-native`` / ``paged-native``: the native CPU decode routine (``attention.cpu_decode``),
  one call for all sequences reading each slot view, or each block through its table, in place;
* ``contiguous``: the same SDPA call over K/V already contiguous (no cache at all): the floor of
  the SDPA paths.

Variants and layouts alternate call by call, so machine drift hits all alike; their order rotates
from call to call, and the caches are flushed before each timed call (a write over a buffer larger
than the L3), as a forward's weights flush them between two layers. Without both, a variant that
always runs right after another one over the same K/V finds it cached, and the order of the
variants decides the ranking (measured: SmolLM2's per-sequence path looked 15 % faster than the
batched one that way; rotated and flushed, batching wins where padding is small). Outputs are
compared (``max_err`` against the per-sequence path of the same layout).

    python experiments/bench_decode_layout.py                 # tiny-llama and smollm2-135m shapes
    python experiments/bench_decode_layout.py --batch 32 --min-len 80 --max-len 200 --calls 200
    python experiments/bench_decode_layout.py --models smollm2-135m --batch 4 --min-len 1900 --max-len 2100 \
        --calls 60 --stem decode_layout_long_cpu --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vmemkv import CacheConfig, KVCacheManager
from vmemkv.attention import BlockTableAttention, ContiguousAttention, SequenceSpan
from vmemkv.engine.models.zoo import BUILTIN_MODELS

LAYOUTS = ("token_major", "per_layer")
VARIANTS = ("vmem", "vmem-per-seq", "paged", "vmem-native", "paged-native")
CPU = torch.device("cpu")
FLUSH_BYTES = 64 << 20  # more than this machine's L3 (32 MiB)


def shape_of(model: str) -> tuple[int, int, int, int]:
    """(layers, query heads, kv heads, head dim) of a built-in model."""
    config = BUILTIN_MODELS[model]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim


class Setup:
    """A manager of one layout with ``lengths[i]`` cached tokens in slot ``i`` (random K/V), each
    decoding one more token."""

    def __init__(self, model: str, layout: str, lengths: list[int], dtype: torch.dtype):
        layers, self.heads, kv_heads, self.head_dim = shape_of(model)
        max_len = max(lengths) + 64
        self.manager = KVCacheManager(CacheConfig(
            num_layers=layers, num_kv_heads=kv_heads, head_dim=self.head_dim,
            num_blocks=len(lengths) * (-(-max_len // 16) + 1), max_num_seqs=len(lengths),
            max_model_len=max_len, dtype=dtype, layout=layout))
        generator = torch.Generator().manual_seed(0)
        self.spans = []
        for slot, cached in enumerate(lengths):
            self.manager.admit(str(slot), list(range(1, cached + 2)), slot=slot)
            self.spans.append(SequenceSpan(slot, slot, 1, cached, tuple(self.manager.block_table(str(slot)))))
        for layer in range(layers):
            for view in self.manager.kv_views(layer):
                for slot, cached in enumerate(lengths):
                    view[slot, :cached + 1].copy_(torch.randn(view[slot, :cached + 1].shape,
                                                              generator=generator))
        self.stats_before = self.manager.slots.stats.map_calls

    def attention(self, variant: str):
        manager = self.manager
        if variant == "vmem":
            return ContiguousAttention(self.spans, manager.kv_views, CPU, reads=manager.batched_reads())
        if variant == "vmem-per-seq":
            return ContiguousAttention(self.spans, manager.kv_views, CPU)
        if variant == "vmem-native":
            return ContiguousAttention(self.spans, manager.kv_views, CPU, decode_kernel=True)
        native = variant == "paged-native"
        return BlockTableAttention(self.spans, manager.block_views, manager.tokens_per_page, CPU, native)


def contiguous_call(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, query: torch.Tensor):
    """The floor: the same folded-GQA masked SDPA over K/V ``[B, Hk, L, D]`` already contiguous."""
    batch, kv_heads, _, head_dim = k.shape
    q = query[0].transpose(0, 1).reshape(batch, kv_heads, -1, head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bench(model: str, batch: int, min_len: int, max_len: int, calls: int, seed: int,
          dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator).tolist()
    setups = {layout: Setup(model, layout, lengths, dtype) for layout in LAYOUTS}
    first = setups[LAYOUTS[0]]
    heads, head_dim, kv_heads = first.heads, first.head_dim, first.manager.layout.num_kv_heads
    query = torch.randn(1, heads, batch, head_dim, generator=generator, dtype=dtype)
    key, value = (torch.randn(1, kv_heads, batch, head_dim, generator=generator, dtype=dtype)
                  for _ in range(2))
    longest = max(lengths) + 1
    k_flat, v_flat = (torch.randn(batch, kv_heads, longest, head_dim, generator=generator, dtype=dtype)
                      for _ in range(2))
    mask = (torch.arange(longest) <= torch.tensor(lengths)[:, None])[:, None, None, :]
    layer = 0
    flush = torch.zeros(FLUSH_BYTES // 4)
    times: dict[str, list[float]] = {f"{layout}/{v}": [] for layout in LAYOUTS for v in VARIANTS}
    times["contiguous"] = []
    outputs = {}
    order = [(layout, variant) for layout in LAYOUTS for variant in VARIANTS]
    with torch.inference_mode():
        for call in range(calls):
            # Rotated call by call: no variant always runs right after the same other one.
            shift = call % len(order)
            for layout, variant in order[shift:] + order[:shift]:
                setup = setups[layout]
                attention = setup.attention(variant)  # built per step, as the engine does
                attention.upload()
                flush.add_(1.0)
                start = time.perf_counter()
                out = attention(layer, query, key, value, None)
                times[f"{layout}/{variant}"].append(time.perf_counter() - start)
                setup.manager.slots.release_reads()
                outputs[f"{layout}/{variant}"] = out
            flush.add_(1.0)
            start = time.perf_counter()
            contiguous_call(k_flat, v_flat, mask, query)
            times["contiguous"].append(time.perf_counter() - start)
    max_err = {name: float((out - outputs[f"{name.split('/')[0]}/vmem-per-seq"]).abs().max())
               for name, out in outputs.items()}
    filler_map_calls = {layout: s.manager.slots.stats.map_calls - s.stats_before for layout, s in setups.items()}
    # Which path the batching rule (slot_batch.worth_batching) chose for "vmem" and "paged".
    chosen = {}
    for layout, setup in setups.items():
        for variant in ("vmem", "paged"):
            chosen[f"{layout}/{variant}"] = "batched" if setup.attention(variant).batches else "per-seq"
            setup.manager.slots.release_reads()
    for setup in setups.values():
        setup.manager.close()
    result = {"model": model, "batch": batch, "lengths": [min(lengths), max(lengths)],
              "dtype": str(dtype).removeprefix("torch."), "calls": calls,
              "ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
              "max_err": max_err, "filler_map_calls": filler_map_calls, "path": chosen}
    print(json.dumps(result), flush=True)
    return result


def markdown(results: list[dict], command: str, load: tuple) -> str:
    names = [f"{layout}/{v}" for layout in LAYOUTS for v in VARIANTS]
    lines = [f"`{command}` — {torch.get_num_threads()} thread(s), load before {load[0]:.2f}; one layer's attention call "
             "(write + attend), ms, median over calls, caches flushed before each", "",
             "| model | B | lengths | dtype | " + " | ".join(names) + " | contiguous floor | path chosen |",
             "|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for r in results:
        ms = r["ms"]
        paths = ", ".join(f"{name} {path}" for name, path in r["path"].items())
        lines.append(f"| {r['model']} | {r['batch']} | {r['lengths'][0]}-{r['lengths'][1]} | {r['dtype']} | "
                     + " | ".join(f"{ms[n]:.3f}" for n in names) + f" | {ms['contiguous']:.3f} | {paths} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=80)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="experiments/results/local",
                        help="writes <stem>.json and .md here (untracked by default)")
    parser.add_argument("--stem", default="decode_layout_cpu", help="the results' file name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    results = [bench(m, args.batch, args.min_len, args.max_len, args.calls, args.seed, getattr(torch, d))
               for m in args.models for d in args.dtypes]
    command = "python " + " ".join(sys.argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps({"command": command, "load": load,
                                                        "results": results}, indent=1))
    (out / f"{args.stem}.md").write_text(markdown(results, command, load))
    print(markdown(results, command, load))


if __name__ == "__main__":
    main()
