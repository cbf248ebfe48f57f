"""The native CPU attention routines over a whole model's layers of a token-major cache, one thread.

A step's attention as the engine runs it on SmolLM2-135M's shape (30 layers, 9 query and 3 KV
heads of 64, float32 or ``--dtype bfloat16``): each layer's K and V are strided views of one ``[slot, token, layer, k|v,
head, dim]`` buffer, so one layer's rows of consecutive tokens lie a whole model's token stride
(46 KB) apart, and the 30 layers of a step read more than the caches hold.

* decode: ``B`` sequences of ``context`` tokens, one query each, every layer once: the routine
  with a KV head's query heads read together on 16-float vectors (AVX-512) and one head at a time
  on 8-float ones (AVX2's path, which AVX-512 CPUs can be told to take), ms a step and GB/s of K
  and V read;
* prefill: ``prompts`` sequences of ``prompt`` new tokens each, causal, every layer once: the
  native routine (AVX-512 only) against SDPA one sequence a call (what the engine runs without it).

Medians over ``--steps`` steps.

    python experiments/bench_cpu_attention.py
    python experiments/bench_cpu_attention.py --batch 4 --context 2000
    python experiments/bench_cpu_attention.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vmemkv.attention import cpu_decode
from vmemkv.attention.cpu_decode import decode_attention_contiguous_cpu
from vmemkv.attention.cpu_prefill import PrefillSpans, prefill_attention_cpu
from vmemkv.attention.cpu_prefill import unavailable as prefill_unavailable

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def layer_views(batch: int, tokens: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = torch.randn(batch, tokens, LAYERS, 2, KV_HEADS, HEAD_DIM, dtype=dtype)
    return [(cache[:, :, layer, 0], cache[:, :, layer, 1]) for layer in range(LAYERS)]


def median_ms(step, steps: int) -> float:
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode(batch: int, context: int, steps: int, dtype: torch.dtype) -> list[str]:
    views = layer_views(batch, context, dtype)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    slots, lens = torch.arange(batch, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32)

    def step():
        for k, v in views:
            decode_attention_contiguous_cpu(q, k, v, slots, lens, HEAD_DIM ** -0.5, out=out, num_threads=1)

    kv_bytes = batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    extension = cpu_decode._extension()
    paths = [True, False] if extension.grouped_heads() else [False]
    lines = []
    before = extension.grouped_heads()
    try:
        for grouped in paths:
            extension.grouped_heads(grouped)
            ms = median_ms(step, steps)
            name = "grouped heads, 16-float vectors" if grouped else "one head at a time, 8-float vectors"
            lines.append(f"| decode | {batch} x {context} tokens | {name} | {ms:.2f} | {kv_bytes / ms / 1e6:.1f} |")
    finally:
        extension.grouped_heads(before)
    return lines


def prefill(prompts: int, prompt: int, steps: int, dtype: torch.dtype) -> list[str]:
    views = layer_views(prompts, prompt, dtype)
    q = torch.randn(prompts * prompt, Q_HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    spans = PrefillSpans([b * prompt for b in range(prompts)], [prompt] * prompts, [0] * prompts,
                         list(range(prompts)))

    def native():
        for k, v in views:
            prefill_attention_cpu(q, k, v, spans, HEAD_DIM ** -0.5, out, num_threads=1)

    def sdpa():
        for k, v in views:
            for b in range(prompts):
                F.scaled_dot_product_attention(q[b * prompt:(b + 1) * prompt].transpose(0, 1), k[b].transpose(0, 1),
                                               v[b].transpose(0, 1), is_causal=True, enable_gqa=True)

    shape = f"{prompts} x {prompt} tokens"
    lines = [f"| prefill | {shape} | SDPA, a call per sequence | {median_ms(sdpa, steps):.1f} | |"]
    if why := prefill_unavailable(dtype, Q_HEADS, KV_HEADS, HEAD_DIM):
        return lines + [f"| prefill | {shape} | native: not here ({why}) | | |"]
    return lines + [f"| prefill | {shape} | native | {median_ms(native, steps):.1f} | |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="decoding sequences")
    parser.add_argument("--context", type=int, default=300, help="tokens each decoding sequence attends")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256, help="new tokens of each prompt")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of Q, K, V")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"SmolLM2-135M's attention shape ({LAYERS} layers, {Q_HEADS} query / {KV_HEADS} KV heads of "
          f"{HEAD_DIM}, {args.dtype}), token-major cache, one thread; ms a step (every layer once), median of "
          f"{args.steps}\n")
    print("| routine | work | path | ms | GB/s of K and V |\n|---|---|---|---:|---:|")
    print("\n".join(decode(args.batch, args.context, args.steps, dtype)
                    + prefill(args.prompts, args.prompt, args.steps, dtype)))


if __name__ == "__main__":
    main()
