"""The lossy cold tier on a multi-tenant shared-prefix workload: more prefix hits at equal memory,
and how close the answers stay.

Workload: ``--tenants`` tenants, each one of the A/B's four real ``chat-real`` assistants (their
system prompts, ~300 tokens each in SmolLM2's template) under a cache salt of its own (tenants
never share cached pages), so the distinct system prompts need several times the device pool
(``--num-blocks``: at the defaults, 16 tenants' ~300-token system prompts hold ~300 pages of 16
tokens, 2.7 times the pool of 112). ``--requests`` requests, each a tenant's system prompt and one of its
assistant's real questions, tenants in a seeded random order, arrive in waves of
``--concurrency`` (a wave runs to completion before the next: a closed loop), greedy,
``--answer-tokens`` new tokens each.

Variants, at equal device memory (``--num-blocks``) and, for the lower tiers, equal host bytes
(``--tier-mib``): ``exact`` (no lower tier: an evicted page is recomputed), ``host`` (the
lossless host tier), ``cold-int8`` and ``cold-int4`` (the cold tier: int8 keeps a float32 page in
9 bits a value, int4 in 5, so the same bytes hold 3.6x / 6.4x the pages). Reported per variant:
prefix hit rate, prompt tokens computed, TTFT p50 / p99, the run's tokens per second, and against
the ``exact`` run's answers (the reference: every token computed exactly): how many answers are
identical, and for the others the first position where they differ.

    python experiments/bench_cold_tier.py                                  # readable table
    python experiments/bench_cold_tier.py --quick                          # smoke run, tiny model
    python experiments/bench_cold_tier.py --out experiments/results        # cold_tier_cpu.md/.json
    python experiments/bench_cold_tier.py --kv-cache-dtype int8 --dtype bfloat16 --variants exact,cold-int8,cold-int4

``--kv-cache-dtype`` int8 / fp8: every variant keeps its live KV quantized (the cold tier then
compresses the rows' values, ``block_codec.QuantizedBlockCodec``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from vmemkv.ab.chat_text import load_chat_prompts, render_chat
from vmemkv.cache.hashing import CacheKeys
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.metrics import percentile
from machine import cpu_flags_note, cpu_model, write_results  # experiments/machine.py

VARIANTS = ("exact", "host", "cold-int8", "cold-int4")


def workload(tokenizer, tenants: int, requests: int, seed: int) -> list[tuple[str, list[int], str]]:
    """(request id, prompt ids, tenant salt) in arrival order."""
    assistants = load_chat_prompts()["assistants"]
    rng = random.Random(seed)
    out = []
    for index in range(requests):
        tenant = rng.randrange(tenants)
        assistant = assistants[tenant % len(assistants)]
        question = rng.choice(assistant["questions"])
        out.append((f"r{index}", render_chat(tokenizer, assistant["system"], question), f"tenant-{tenant}"))
    return out


def engine_for(variant: str, args) -> LLMEngine:
    tier = args.tier_mib << 20
    options = {"exact": {}, "host": {"host_cache_bytes": tier},
               "cold-int8": {"kv_cold_tier": "int8", "kv_cold_cache_bytes": tier},
               "cold-int4": {"kv_cold_tier": "int4", "kv_cold_cache_bytes": tier}}[variant]
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", threads=args.threads,
                                  max_num_seqs=args.concurrency, max_model_len=args.max_model_len,
                                  num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype, **options))


def run(variant: str, args) -> dict:
    engine = engine_for(variant, args)
    requests = workload(engine.tokenizer, args.tenants, args.requests, args.seed)
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    answers: dict[str, list[int]] = {}
    start = time.perf_counter()
    for wave in range(0, len(requests), args.concurrency):
        for request_id, prompt, salt in requests[wave:wave + args.concurrency]:
            engine.add_request(request_id, prompt, params, keys=CacheKeys(cache_salt=salt))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    answers[output.request_id] = list(output.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    stats, ttft = engine.stats(), sorted(t * 1e3 for t in engine.metrics.ttft_s)
    queried = stats["prefix_queried_tokens"]
    result = {
        "variant": variant, "seconds": seconds,
        "tokens_per_second": sum(len(a) for a in answers.values()) / seconds,
        "prefix_hit_rate": stats["prefix_hit_tokens"] / queried if queried else 0.0,
        "prompt_tokens": sum(len(p) for _, p, _ in requests),
        "prompt_tokens_computed": queried - stats["prefix_hit_tokens"],
        "hit_tokens": {tier: stats[f"prefix_hit_tokens_{tier}"] for tier in ("device", "host", "cold")},
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "block_bytes": engine.manager.block_bytes, "layout": engine.manager.layout,
        "lower_tier_blocks": engine.manager.host_tier.capacity + engine.manager.cold_tier.capacity,
        "answers": answers,
    }
    engine.close()
    return result


def codec_speed(layout, repeats: int = 5) -> dict:
    """Milliseconds to compress and to decompress one of the model's blocks (16 at a time, in
    torch ops at this process's threads), per format; quantized live KV through its own codec."""
    from vmemkv.cache.block_codec import BlockCodec, QuantizedBlockCodec

    if layout.scaled:  # random bytes, and scales that are plain floats
        blocks = torch.randint(-100, 100, (16, layout.block_bytes), dtype=torch.int8).view(torch.uint8)
        make = lambda fmt: QuantizedBlockCodec(fmt, layout)  # noqa: E731
        for values, scales in make("int8").row_views(blocks):
            scales.uniform_(0.01, 0.1)
    else:
        blocks = torch.randn(16, layout.block_bytes // layout.itemsize).to(layout.dtype).view(torch.uint8)
        make = lambda fmt: BlockCodec(fmt, layout.dtype, layout.block_bytes, layout.head_dim,  # noqa: E731
                                      layout.head_dim)
    out = {}
    for fmt in ("int8", "int4"):
        codec = make(fmt)
        packed = codec.compress(blocks)  # warm
        start = time.perf_counter()
        for _ in range(repeats):
            packed = codec.compress(blocks)
        middle = time.perf_counter()
        for _ in range(repeats):
            codec.decompress(packed)
        end = time.perf_counter()
        out[fmt] = {"compress_ms": (middle - start) / repeats / 16 * 1e3,
                    "decompress_ms": (end - middle) / repeats / 16 * 1e3}
    return out


def agreement(rows: list[dict]) -> None:
    """Each row's answers against the exact run's: identical ones, first differing positions."""
    reference = next(r for r in rows if r["variant"] == "exact")["answers"]
    for row in rows:
        firsts = []
        for request_id, tokens in row["answers"].items():
            same = reference[request_id]
            if tokens != same:
                firsts.append(next(i for i, (a, b) in enumerate(zip(tokens, same)) if a != b))
        row["answered"] = len(row["answers"])
        row["identical_answers"] = row["answered"] - len(firsts)
        row["first_difference"] = sorted(firsts)


def markdown(results: dict) -> str:
    a = results["args"]
    lines = ["# The cold tier on a multi-tenant shared-prefix workload", "",
             f"`{results['command']}` ({results['date']}, {results['cpu']} ({results['cpu_flags']}), "
             f"{a['threads']} thread(s); {a['model']} in {a['dtype']}"
             f"{'' if a.get('kv_cache_dtype', 'auto') == 'auto' else ', live KV in ' + a['kv_cache_dtype']}; "
             f"{a['tenants']} tenants (the four "
             f"chat-real assistants, each under cache salts of its own), {a['requests']} requests in waves "
             f"of {a['concurrency']}, {a['answer_tokens']} greedy tokens each; device pool "
             f"{a['num_blocks']} blocks of {results['rows'][0]['block_bytes']:,} B; lower tier "
             f"{a['tier_mib']} MiB of host memory).", "",
             "| variant | lower-tier pages | prefix hit rate | prompt tokens computed | hits device / host / cold | "
             "TTFT p50 / p99 ms | tok/s | answers identical to exact | first difference at |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in results["rows"]:
        h = r["hit_tokens"]
        firsts = ", ".join(map(str, r["first_difference"][:8])) + (" ..." if len(r["first_difference"]) > 8 else "")
        lines.append(f"| {r['variant']} | {r['lower_tier_blocks']} | {r['prefix_hit_rate']:.1%} | "
                     f"{r['prompt_tokens_computed']:,} of {r['prompt_tokens']:,} | {h['device']:,} / {h['host']:,} / "
                     f"{h['cold']:,} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['tokens_per_second']:.1f} | {r['identical_answers']} / {r['answered']} | "
                     f"{firsts or '-'} |")
    exact = next(r for r in results["rows"] if r["variant"] == "exact")["prefix_hit_rate"]
    ratios = "; ".join(f"{r['variant']} {r['prefix_hit_rate'] / exact:.2f}x" for r in results["rows"]
                       if r["variant"] != "exact" and exact)
    lines += ["", f"Prefix hit rate over exact-only's: {ratios}."]
    speed = results.get("codec_ms")
    if speed:
        lines += ["", "The codec on one of these blocks (torch ops, 16 blocks at a time): " + "; ".join(
            f"{fmt} compress {v['compress_ms']:.2f} ms, decompress {v['decompress_ms']:.2f} ms"
            for fmt, v in speed.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=112)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tier-mib", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="how every variant stores its live KV")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, a few requests: a smoke run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        # tiny-llama reads the text as UTF-8 bytes: up to ~1,700 tokens a prompt
        args.model, args.tenants, args.requests, args.answer_tokens = "tiny-llama", 6, 12, 8
        args.max_model_len, args.num_blocks, args.tier_mib = 2048, 520, 1
    variants = args.variants.split(",")
    if "exact" not in variants:
        variants.insert(0, "exact")  # the reference answers
    rows = []
    for variant in variants:
        rows.append(run(variant, args))
        print(f"{variant}: hit rate {rows[-1]['prefix_hit_rate']:.1%}, {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    agreement(rows)
    for row in rows:  # counted: the answers themselves stay out of the results file
        del row["answers"]
    layout = rows[0]["layout"]
    for row in rows:
        del row["layout"]
    results = {"codec_ms": codec_speed(layout),
               "command": "python experiments/bench_cold_tier.py " + " ".join(sys.argv[1:]),
               "date": datetime.date.today().isoformat(), "cpu": cpu_model(), "cpu_flags": cpu_flags_note(),
               "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": None},
               "rows": rows, "torch": torch.__version__}
    text = markdown(results)
    print(text)
    if args.out:
        write_results(args.out, "cold_tier_cpu", results, text)


if __name__ == "__main__":
    main()
