"""The prefix cache's host tier on a multi-turn chat: does it turn device evictions into hits,
and what does that do to the time to first token and the prefill work?

Workload: ``--conversations`` chats, each with its own system prompt, take turns; each turn
re-sends the whole conversation so far (system prompt, earlier user messages and answers) plus a
new user message, greedy, ``--answer-tokens`` new tokens. Between two turns of a chat, other
traffic (``--traffic`` one-off requests of fresh prompts) runs through a device pool too small to
keep every chat's pages, so a chat's pages are evicted before its next turn. Each chat turn runs
alone, so its TTFT is the admission plus its own prefill.

Run once without the tier (``host_cache_bytes=0``: evicted pages are gone, the turn recomputes
them) and once with it (evicted pages wait in host memory and come back on the hit), the two
alternating ``--repeats`` times. Reported per setting: chat turns' TTFT p50/p99 (turns after the
first of each chat), prompt tokens the chat turns computed, prefix hits by tier, the fraction of
device evictions the tier turned into hits (promotions / demotions), and the host copies' time
(measured around the host block store's copy routine, which swap preemption's copies also go
through; on the CPU a plain row copy, on CUDA the time to enqueue the asynchronous copy). Most
demoted pages are the traffic's, never asked for again; "re-sent conversation served from cache"
is the share of each turn's re-sent conversation (all computed before) not computed again.

    python experiments/bench_host_tier.py                  # readable table
    python experiments/bench_host_tier.py --json           # one JSON object
    python experiments/bench_host_tier.py --quick          # smoke run, seconds
    python experiments/bench_host_tier.py --out experiments/results   # host_tier_<device>.md/.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.core.metrics import percentile
from vmemkv.cache.swap import SwapSpace
from machine import cpu_model  # experiments/machine.py, beside this script


class CopyTimer:
    """Seconds spent in the host block store's copy routine (swap and the host tier share it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self._inner = SwapSpace._copy_rows

    def __enter__(self):
        inner, timer = self._inner, self

        def timed(store, dst, dst_rows, src, src_rows):
            start = time.perf_counter()
            inner(store, dst, dst_rows, src, src_rows)
            timer.seconds += time.perf_counter() - start
            timer.rows += len(dst_rows)

        SwapSpace._copy_rows = timed
        return self

    def __exit__(self, *exc) -> None:
        SwapSpace._copy_rows = self._inner


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


def run_until_first_token(engine: LLMEngine, request_id: str, prompt: list[int],
                          params: SamplingParams) -> tuple[float, list[int]]:
    """TTFT and the generated tokens of one request run alone."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft, final = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if output.finished:
                final = output.outputs[0].token_ids
    return ttft, final


def run_traffic(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_chat(args, host_cache_bytes: int) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    max_num_seqs=args.traffic, max_model_len=args.max_model_len,
                                    num_blocks=args.num_blocks, host_cache_bytes=host_cache_bytes,
                                    tokens_per_page=args.tokens_per_page))
    rng = random.Random(args.seed)
    answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    traffic = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    history = [tokens(rng, args.system_tokens) for _ in range(args.conversations)]
    ttfts, computed, queried, resent, answers = [], 0, 0, 0, []
    with CopyTimer() as copies:
        for turn in range(args.turns):
            for chat in range(args.conversations):
                prompt = history[chat] + tokens(rng, args.user_tokens)
                before = engine.manager.cache_stats()
                ttft, answer_ids = run_until_first_token(engine, f"c{chat}t{turn}", prompt, answer)
                after = engine.manager.cache_stats()
                if turn:  # the first turn of a chat has nothing cached
                    ttfts.append(ttft)
                    resent += len(history[chat])
                    queried += after.prefix_queried_tokens - before.prefix_queried_tokens
                    computed += (after.prefix_queried_tokens - before.prefix_queried_tokens) - (
                        after.prefix_hit_tokens - before.prefix_hit_tokens)
                history[chat] = prompt + answer_ids
                answers.append(answer_ids)
                run_traffic(engine, [tokens(rng, args.traffic_tokens) for _ in range(args.traffic)],
                            traffic, f"x{chat}t{turn}")
    stats = engine.manager.cache_stats()
    engine.manager.check()
    result = {
        "host_cache_bytes": host_cache_bytes,
        "ttft_p50_ms": 1e3 * percentile(sorted(ttfts), 50),
        "ttft_p99_ms": 1e3 * percentile(sorted(ttfts), 99),
        "chat_prompt_tokens": queried, "chat_prefill_tokens_computed": computed,
        # of the conversation re-sent each turn (all of it was computed before), the share the
        # turn did not compute again
        "resent_tokens_served": (queried - computed) / resent if resent else 0.0,
        "prefix_hit_tokens_device": stats.prefix_hit_tokens_device,
        "prefix_hit_tokens_host": stats.prefix_hit_tokens_host,
        "device_evictions": engine.manager.snapshot_stats()["evictions"],
        "host_demotions": stats.host_demotions, "host_promotions": stats.host_promotions,
        "host_evictions": stats.host_evictions,
        "evictions_turned_into_hits": stats.host_promotions / stats.host_demotions
        if stats.host_demotions else 0.0,
        "host_bytes_copied": stats.host_bytes_demoted + stats.host_bytes_promoted,
        "host_copy_seconds": copies.seconds, "host_copy_blocks": copies.rows,
        "host_copy_us_per_block": 1e6 * copies.seconds / copies.rows if copies.rows else None,
        "block_bytes": engine.manager.block_bytes,
        "answers": answers,
    }
    engine.manager.close()
    return result


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=192)
    parser.add_argument("--user-tokens", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--traffic", type=int, default=4, help="one-off requests between two turns")
    parser.add_argument("--traffic-tokens", type=int, default=160)
    parser.add_argument("--tokens-per-page", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64, help="device pool, in pages")
    parser.add_argument("--host-cache-bytes", type=int, default=None,
                        help="host tier size; default: room for 1024 pages")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.conversations, args.turns, args.repeats = "tiny-llama", 2, 3, 1
        args.system_tokens, args.traffic_tokens, args.num_blocks = 64, 96, 24
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    torch.set_num_threads(1) if args.device == "cpu" else None

    probe = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                   max_num_seqs=1, max_model_len=args.max_model_len, num_blocks=1,
                                   tokens_per_page=args.tokens_per_page))
    block_bytes = probe.manager.block_bytes
    probe.manager.close()
    host_bytes = args.host_cache_bytes if args.host_cache_bytes is not None else 1024 * block_bytes
    runs = {"without_tier": [], "with_tier": []}
    for _ in range(args.repeats):  # alternating, so drift on a shared machine hits both alike
        runs["without_tier"].append(run_chat(args, 0))
        runs["with_tier"].append(run_chat(args, host_bytes))
    same_tokens = all(a["answers"] == b["answers"] for a, b in zip(runs["without_tier"], runs["with_tier"]))
    summary = {}
    for name, results in runs.items():
        row = {key: median_of(results, key) for key in ("ttft_p50_ms", "ttft_p99_ms",
                                                        "host_copy_seconds")}
        last = results[-1]
        row.update({key: value for key, value in last.items()
                    if key not in row and key != "answers"})
        summary[name] = row
    report = {
        "benchmark": "host_tier", "date": datetime.date.today().isoformat(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": cpu_model(), "torch": torch.__version__, "command": " ".join(sys.argv),
        "workload": {key: getattr(args, key) for key in (
            "model", "dtype", "conversations", "turns", "system_tokens", "user_tokens",
            "answer_tokens", "traffic", "traffic_tokens", "tokens_per_page", "num_blocks",
            "repeats")} | {"host_cache_bytes": host_bytes, "block_bytes": block_bytes},
        "same_greedy_tokens_with_and_without_tier": same_tokens,
        "results": summary,
    }
    table = markdown(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"host_tier_{'cpu' if args.device == 'cpu' else 'cuda'}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table + "\n")
    return 0 if same_tokens else 1


def markdown(report: dict) -> str:
    rows = [("TTFT p50 (ms), turns 2+", "ttft_p50_ms", "{:.1f}"),
            ("TTFT p99 (ms), turns 2+", "ttft_p99_ms", "{:.1f}"),
            ("chat prompt tokens (turns 2+)", "chat_prompt_tokens", "{}"),
            ("prefill tokens computed (turns 2+)", "chat_prefill_tokens_computed", "{}"),
            ("re-sent conversation served from cache", "resent_tokens_served", "{:.1%}"),
            ("prefix hit tokens, device", "prefix_hit_tokens_device", "{}"),
            ("prefix hit tokens, host", "prefix_hit_tokens_host", "{}"),
            ("device evictions (pages)", "device_evictions", "{}"),
            ("demotions / promotions / host evictions", None, None),
            ("evictions turned into hits (promotions / demotions)", "evictions_turned_into_hits",
             "{:.1%}"),
            ("host bytes copied", "host_bytes_copied", "{:,}"),
            ("host store copy time (s) / µs per page (swap's too)", None, None)]
    without, with_tier = report["results"]["without_tier"], report["results"]["with_tier"]
    lines = [f"Host tier on a multi-turn chat ({report['workload']['model']}, {report['device']}, "
             f"{report['date']}): `{report['command']}`", "",
             "| | without tier | with tier |", "|---|---:|---:|"]
    for label, key, fmt in rows:
        if label.startswith("demotions"):
            cells = [f"{r['host_demotions']} / {r['host_promotions']} / {r['host_evictions']}"
                     for r in (without, with_tier)]
        elif label.startswith("host store copy"):
            cells = [f"{r['host_copy_seconds']:.4f} / " + (
                f"{r['host_copy_us_per_block']:.0f}" if r["host_copy_us_per_block"] else "-")
                for r in (without, with_tier)]
        else:
            cells = [fmt.format(r[key]) for r in (without, with_tier)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += ["", f"Same greedy tokens with and without the tier: "
              f"{report['same_greedy_tokens_with_and_without_tier']}. Workload: "
              + ", ".join(f"{k}={v}" for k, v in report["workload"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
