"""Cache-aware scheduling: FCFS against ``--policy lpm`` (longest cached prefix first, with its
passed-over bound and in-batch sharing), the policies alternating on the same engine and requests.

The workload LPM is for is the A/B harness's ``prefix-groups`` (``vmemkv/ab/workloads.py``: 8
groups x 6 questions after each group's 8-page system prompt, groups taking turns, on a pool of
the running requests plus about two system prompts), under two arrival patterns:

* ``batch``: every request is added before the first step (as ``vmemkv ab`` does);
* ``stream``: ``--arrivals-per-step`` requests are added before each step, in the workload's
  interleaved order, faster than the engine finishes them, so a queue builds up.

The other A/B workloads run too (``batch``), to check that LPM costs nothing where the cache
cannot help. Both KV backends (vmem slots and the block-table baseline) run under both policies,
the policies alternating (which goes first alternates too), ``--repeats`` times. Reported per
(scenario, backend, policy): prefix hit rate, prompt tokens computed, TTFT p50/p99 from each
request's arrival, output tokens per wall second and per CPU second, steps, preemptions, and
whether every completion's tokens equal FCFS's on the same backend.

    python experiments/bench_prefix_sched.py             # table; files in experiments/results/local
    python experiments/bench_prefix_sched.py --quick     # smoke run: quick sizes, prefix-groups only
    python experiments/bench_prefix_sched.py --out experiments/results   # prefix_sched_cpu.md / .json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from vmemkv.ab.workloads import make_workload
from vmemkv.engine import EngineConfig, LLMEngine
from vmemkv.engine.core.metrics import percentile
from vmemkv.engine.models.zoo import load_model
from machine import cpu_model  # experiments/machine.py, beside this script

POLICIES = ("fcfs", "lpm")
BACKENDS = ("vmem", "paged")
# (workload, arrival): what LPM is for first, then the A/B's other workloads all at once
SCENARIOS = (("prefix-groups", "batch"), ("prefix-groups", "stream"), ("chat", "batch"),
             ("shared-prefix", "batch"), ("parallel-n4", "batch"), ("pressure", "batch"),
             ("long-context", "batch"))
METRICS = ("prefix_hit_rate", "prompt_tokens_computed", "ttft_p50_ms", "ttft_p99_ms",
           "ttft_cpu_p50_ms", "ttft_cpu_p99_ms",
           "output_tokens_per_s", "output_tokens_per_cpu_s", "num_steps", "preemptions")


def run_once(model, tokenizer, workload, backend: str, policy: str, arrivals_per_step: int | None,
             seed: int) -> tuple[dict, dict]:
    """One run on a fresh engine: (metrics, request id -> output token ids)."""
    config = EngineConfig(model="tiny-llama", seed=seed, kv_backend=backend, policy=policy,
                          **workload.engine)
    engine = LLMEngine(config, model, tokenizer, stream=True)
    pending = list(workload.requests)
    added: dict[str, tuple[float, float]] = {}  # wall and CPU clocks at arrival
    first_token: dict[str, tuple[float, float]] = {}
    tokens: dict[str, list[int]] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        while pending or engine.has_unfinished_requests():
            count = len(pending) if arrivals_per_step is None else arrivals_per_step
            for request_id, prompt, params in pending[:count]:
                engine.add_request(request_id, list(prompt), params)
                added[request_id] = (time.perf_counter(), time.process_time())
            del pending[:count]
            outputs = engine.step()
            now = (time.perf_counter(), time.process_time())
            for output in outputs:
                if output.error:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                if output.outputs[0].token_ids:
                    first_token.setdefault(output.request_id, now)
                if output.finished:
                    tokens[output.request_id] = [list(c.token_ids) for c in output.outputs]
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        stats = engine.manager.cache_stats()
        steps, preemptions = engine.num_steps, engine.scheduler.num_preemptions
    finally:
        engine.close()
    ttft = sorted(first_token[rid][0] - added[rid][0] for rid in added)
    ttft_cpu = sorted(first_token[rid][1] - added[rid][1] for rid in added)
    output_tokens = sum(len(ids) for completions in tokens.values() for ids in completions)
    computed = (stats.prefix_queried_tokens - stats.prefix_hit_tokens
                + stats.reprefill_queried_tokens - stats.reprefill_hit_tokens)
    metrics = {"prefix_hit_rate": stats.prefix_hit_rate, "prompt_tokens_computed": computed,
               "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
               # the same on this process's CPU clock: steadier than wall time on a shared machine
               "ttft_cpu_p50_ms": 1e3 * percentile(ttft_cpu, 50),
               "ttft_cpu_p99_ms": 1e3 * percentile(ttft_cpu, 99),
               "output_tokens_per_s": output_tokens / wall,
               "output_tokens_per_cpu_s": output_tokens / cpu,
               "num_steps": steps, "preemptions": preemptions}
    return metrics, tokens


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("tiny-llama", seed=args.seed)
    warm = make_workload("prefix-groups", args.seed + 1, quick=True)
    for backend in BACKENDS:  # kernels, allocator and mapper warm before anything is timed
        run_once(model, tokenizer, warm, backend, "fcfs", None, args.seed)
    scenarios = SCENARIOS[:2] if args.quick else SCENARIOS
    workloads = {name: make_workload(name, args.seed, args.quick) for name, _ in scenarios}
    runs = []
    for name, arrival in scenarios:
        per_step = None if arrival == "batch" else args.arrivals_per_step
        for repeat in range(args.repeats):
            for backend in BACKENDS:
                order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]  # alternate who goes first
                for policy in order:
                    metrics, tokens = run_once(model, tokenizer, workloads[name], backend, policy,
                                               per_step, args.seed)
                    runs.append({"workload": name, "arrival": arrival, "backend": backend,
                                 "policy": policy, "repeat": repeat, "metrics": metrics,
                                 "tokens": tokens})
                    print(f"{name} {arrival} {backend} {policy} #{repeat + 1}: "
                          + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()), file=sys.stderr)
    return summarize(runs, scenarios, workloads)


def summarize(runs: list[dict], scenarios, workloads: dict) -> dict:
    rows = []
    for name, arrival in scenarios:
        for backend in BACKENDS:
            def runs_of(policy):
                return [r for r in runs if (r["workload"], r["arrival"], r["backend"], r["policy"])
                        == (name, arrival, backend, policy)]
            fcfs_tokens = runs_of("fcfs")[0]["tokens"]
            for policy in POLICIES:
                mine = runs_of(policy)
                row = {"workload": name, "arrival": arrival, "backend": backend, "policy": policy,
                       "same_tokens_as_fcfs": all(r["tokens"] == fcfs_tokens for r in mine)}
                for key in METRICS:
                    values = [r["metrics"][key] for r in mine]
                    row[key] = {"median": statistics.median(values), "min": min(values),
                                "max": max(values)}
                rows.append(row)
    return {"workloads": {name: w.describe() for name, w in workloads.items()}, "rows": rows,
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}


def markdown(result: dict) -> str:
    lines = ["# Cache-aware scheduling: FCFS against lpm", "", "```bash", result["command"], "```", "",
             f"Machine: {result['machine']}. Medians over {result['repeats']} repeats, the policies "
             "alternating (throughput: min-max). TTFT from each request's arrival; `batch`: all "
             "requests added before the first step, `stream`: "
             f"{result['arrivals_per_step']} added before each step. CPU-ms: this process's CPU time "
             "(all its threads), steadier than wall time when other processes share the cores.", "",
             "| workload | arrival | backend | policy | hit % | prompt tokens computed | TTFT p50 "
             "/ p99 CPU-ms | TTFT p50 / p99 ms | out tok/s | out tok/CPU-s (min-max) | steps | "
             "same tokens as fcfs |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        cpu = row["output_tokens_per_cpu_s"]
        lines.append(
            f"| {row['workload']} | {row['arrival']} | {row['backend']} | {row['policy']} | "
            f"{100 * row['prefix_hit_rate']['median']:.1f} | "
            f"{row['prompt_tokens_computed']['median']:,.0f} | "
            f"{row['ttft_cpu_p50_ms']['median']:,.0f} / {row['ttft_cpu_p99_ms']['median']:,.0f} | "
            f"{row['ttft_p50_ms']['median']:,.0f} / {row['ttft_p99_ms']['median']:,.0f} | "
            f"{row['output_tokens_per_s']['median']:.0f} | "
            f"{cpu['median']:.0f} ({cpu['min']:.0f}-{cpu['max']:.0f}) | "
            f"{row['num_steps']['median']:.0f} | {'yes' if row['same_tokens_as_fcfs'] else 'NO'} |")
    lines += ["", "## Workloads", ""]
    lines += [f"- `{name}`: {w['description']}; engine: "
              + ", ".join(f"{k}={v}" for k, v in w["engine"].items())
              for name, w in result["workloads"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arrivals-per-step", type=int, default=1,
                        help="stream: requests added before each step (default 1)")
    parser.add_argument("--quick", action="store_true", help="the workload's quick size, 1 repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/local"),
                        help="write prefix_sched_cpu.md and .json here (default experiments/results/"
                             "local, untracked; experiments/results records a run)")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    began = time.time()
    result = run(args)
    load = os.getloadavg()
    result.update({
        "command": shlex.join(["python", "experiments/bench_prefix_sched.py", "--repeats",
                               str(args.repeats), "--arrivals-per-step", str(args.arrivals_per_step),
                               "--seed", str(args.seed), "--threads", str(args.threads), "--out",
                               str(args.out)] + (["--quick"] if args.quick else [])),
        "repeats": args.repeats, "arrivals_per_step": args.arrivals_per_step,
        "machine": (f"{os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__}, "
                    f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the end, "
                    f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                    f"{time.time() - began:.0f} s"),
    })
    table = markdown(result)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table)
    if str(args.out):
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_sched_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "prefix_sched_cpu.md").write_text(table)
    failures = [f"{r['workload']}/{r['arrival']}/{r['backend']}/{r['policy']}: tokens differ from fcfs"
                for r in result["rows"] if not r["same_tokens_as_fcfs"]]
    for failure in failures:
        print(f"bench_prefix_sched: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
