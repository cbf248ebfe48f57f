"""Elastic KV memory: two engine processes on one machine with one shared KV budget, against the
same budget split half and half.

Two models (tiny-llama and tiny-qwen2, random weights, CPU) each run in a process of their own
and get bursts in turn: a burst of ``--requests`` requests to one engine, an idle gap of
``--gap`` seconds, a burst to the other, and so on. Each burst's KV peak needs more than half the
budget (``--budget-factor`` x the larger model's burst peak, 1.4 by default: a burst needs 71 %).

* **shared**: both engines name one ``kv_pool`` of the whole budget; an engine idle for
  ``--idle-release`` seconds gives its free KV memory (cached blocks too) back to it.
* **static**: each engine has a pool of half the budget, all its own.

Reported (JSON, a Markdown table, a plot of each engine's resident KV bytes over time):
preemptions, output tokens per second over the bursts (idle gaps excluded), TTFT p99, and
``resident_after_idle_ratio`` (an engine's resident KV bytes ``--gap`` seconds after its burst,
over its burst's peak; shared mode) and ``resident_after_sleep_ratio`` (after ``sleep()``).

    python experiments/bench_elastic.py --json
    python experiments/bench_elastic.py --out experiments/results   # elastic_cpu.json/.md/.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MODELS = ("tiny-llama", "tiny-qwen2")


# --- one engine process ------------------------------------------------------------------------
def worker(conn, model_name: str, threads: int) -> None:
    """Serves commands from the coordinator (``probe``, ``start``, ``burst``, ``idle``, ``sleep``,
    ``stop``) until it closes the pipe; every reply is a dict (``{"error": traceback}`` when the
    command failed)."""
    try:
        serve(conn, model_name, threads)
    except Exception:
        import traceback
        conn.send({"error": traceback.format_exc()})


def serve(conn, model_name: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
    from vmemkv.engine.models.zoo import load_model

    model, tokenizer = load_model(model_name, torch.float32, "cpu", 0)
    base = dict(model=model_name, max_model_len=512, max_num_seqs=32, threads=threads)
    engine, samples = None, []

    def sample() -> None:
        samples.append((time.time(), engine.manager.kv_bytes_resident))

    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the coordinator is done
            return
        if command == "probe":  # the bytes of one KV block of this model
            cache = EngineConfig(**base).cache_config(model)
            conn.send({"block_bytes": cache.make_layout().block_bytes})
        elif command == "start":
            engine = LLMEngine(EngineConfig(**base, **args), model, tokenizer, stream=True)
            conn.send({})
        elif command == "burst":
            prompts, max_tokens = args
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            preempted, start = engine.scheduler.num_preemptions, time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{start}-{i}", prompt, params)
            first, tokens, peak = {}, 0, 0
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.outputs[0].token_ids and output.request_id not in first:
                        first[output.request_id] = time.perf_counter() - start
                    if output.finished:
                        tokens += len(output.outputs[0].token_ids)
                sample()
                peak = max(peak, samples[-1][1])
            conn.send({"seconds": time.perf_counter() - start, "tokens": tokens, "ttft": list(first.values()),
                       "preemptions": engine.scheduler.num_preemptions - preempted, "peak": peak})
        elif command == "idle":  # nothing to do for args seconds: the idle give-back may come
            end = time.time() + args
            while time.time() < end:
                engine.on_idle()
                sample()
                time.sleep(0.02)
            conn.send({"resident": engine.manager.kv_bytes_resident})
        elif command == "sleep":
            engine.sleep(1)
            sample()
            conn.send({"resident": engine.manager.kv_bytes_resident})
        elif command == "stop":  # this mode's engine ends; the next mode starts a new one
            conn.send({"samples": samples})
            engine.close()
            engine, samples = None, []


# --- the coordinator -----------------------------------------------------------------------------
def ask(conn, command: str, args=None) -> dict:
    conn.send((command, args))
    reply = conn.recv()
    if "error" in reply:
        raise RuntimeError(f"the engine process failed at {command!r}:\n{reply['error']}")
    return reply


def prompts_for(engine_index: int, burst: int, args) -> list[list[int]]:
    """Distinct prompts (no prefix hits across bursts), token ids below the models' vocab."""
    return [[(7 * i + 13 * r + 101 * burst + 3 * engine_index) % 500 + 1 for i in range(args.prompt_tokens)]
            for r in range(args.requests)]


def run_mode(mode: str, conns, budget: int, block_bytes: list[int], args) -> dict:
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    for index, conn in enumerate(conns):
        if mode == "shared":
            options = dict(num_blocks=budget // block_bytes[index], kv_pool=pool,
                           kv_idle_release_s=args.idle_release)
            if index == 0:
                options["kv_pool_bytes"] = budget
        else:
            options = dict(num_blocks=budget // 2 // block_bytes[index])
        ask(conn, "start", options)
    bursts, after_idle = [], []
    for burst in range(args.bursts):
        index = burst % 2
        result = ask(conns[index], "burst", (prompts_for(index, burst, args), args.max_tokens))
        bursts.append(result)
        idle = ask(conns[index], "idle", args.gap)
        after_idle.append(idle["resident"] / result["peak"] if result["peak"] else 0.0)
    sleeps = [ask(conn, "sleep")["resident"] for conn in conns]
    peaks = [max(b["peak"] for b in bursts[i::2]) for i in range(2)]
    samples = [ask(conn, "stop")["samples"] for conn in conns]
    ttft = sorted(t for b in bursts for t in b["ttft"])
    seconds, tokens = sum(b["seconds"] for b in bursts), sum(b["tokens"] for b in bursts)
    return {"preemptions": sum(b["preemptions"] for b in bursts),
            "output_tokens_per_s": tokens / seconds, "burst_seconds": seconds, "output_tokens": tokens,
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "peak_resident_bytes": peaks, "resident_after_idle_ratio": max(after_idle),
            "resident_after_sleep_ratio": max(s / p for s, p in zip(sleeps, peaks)),
            "resident_samples": samples}


def markdown(r: dict) -> str:
    rows = ["| | shared budget | static halves |", "|---|---:|---:|"]
    for key, label, fmt in (("preemptions", "preemptions", "{}"),
                            ("output_tokens_per_s", "output tokens/s (bursts)", "{:.1f}"),
                            ("ttft_p99_s", "TTFT p99 (s)", "{:.2f}"),
                            ("resident_after_idle_ratio", f"resident {r['gap_s']:g} s after a burst / its peak", "{:.3f}"),
                            ("resident_after_sleep_ratio", "resident after sleep() / peak", "{:.3f}")):
        rows.append(f"| {label} | {fmt.format(r['shared'][key])} | {fmt.format(r['static'][key])} |")
    return (f"# Elastic KV memory: one shared budget against static halves\n\n"
            f"`{r['command']}` ({r['date']}, {r['cpu']}, load average {r['load_average_1min']:.2f}, "
            f"{r['threads']} torch thread per engine). Two engines ({', '.join(MODELS)}), {r['bursts']} "
            f"alternating bursts of {r['requests']} requests ({r['prompt_tokens']} prompt + "
            f"{r['max_tokens']} output tokens), {r['gap_s']:g} s idle between; budget "
            f"{r['budget_bytes'] / 2**20:.2f} MiB, a burst's peak {r['burst_peak_fraction']:.0%} of it.\n\n"
            + "\n".join(rows) + "\n\nTargets: shared 0 preemptions where static preempts; resident "
            "<= 10 % of the peak within 1 s of idle; <= 5 % after sleep().\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharey=True)
    for ax, mode in zip(axes, ("shared", "static")):
        series = r[mode]["resident_samples"]
        start = min(t for samples in series for t, _ in samples)
        for name, samples in zip(MODELS, series):
            ax.step([t - start for t, _ in samples], [b / 2**20 for _, b in samples], where="post", label=name)
        ax.axhline(r["budget_bytes"] / 2**20 / (1 if mode == "shared" else 2), color="grey", ls="--",
                   label="budget" if mode == "shared" else "each engine's half")
        ax.set_title(f"{mode}: {r[mode]['preemptions']} preemptions, "
                     f"{r[mode]['output_tokens_per_s']:.0f} tok/s")
        ax.set_ylabel("resident KV (MiB)")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--gap", type=float, default=1.0, help="idle seconds after each burst")
    parser.add_argument("--idle-release", type=float, default=0.5,
                        help="shared mode: an engine's idle give-back after this many seconds")
    parser.add_argument("--budget-factor", type=float, default=1.4,
                        help="the budget over the larger model's burst peak")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VMEMKV_KV_POOL_DIR", tempfile.mkdtemp(prefix="vmemkv-bench-"))

    from machine import cpu_model, write_results  # experiments/machine.py, beside this script

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in MODELS]
    procs = [ctx.Process(target=worker, args=(child, name, args.threads), daemon=True)
             for (_, child), name in zip(pipes, MODELS)]
    for proc in procs:
        proc.start()
    for _, child in pipes:
        child.close()  # the processes hold them: a dead one's pipe then reads EOF here
    conns = [parent for parent, _ in pipes]
    try:
        block_bytes = [ask(conn, "probe")["block_bytes"] for conn in conns]
        tokens_per_request = args.prompt_tokens + args.max_tokens
        blocks_per_request = -(-tokens_per_request // 16)
        peak = max(args.requests * blocks_per_request * b for b in block_bytes)
        budget = int(peak * args.budget_factor)
        results = {
            "command": "python experiments/bench_elastic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
            "load_average_1min": os.getloadavg()[0], "threads": args.threads,
            "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "bursts": args.bursts, "gap_s": args.gap, "idle_release_s": args.idle_release,
            "budget_bytes": budget, "burst_peak_fraction": peak / budget, "block_bytes": block_bytes,
        }
        for mode in ("shared", "static"):
            results[mode] = run_mode(mode, conns, budget, block_bytes, args)
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    results["resident_after_idle_ratio"] = results["shared"]["resident_after_idle_ratio"]
    results["resident_after_sleep_ratio"] = results["shared"]["resident_after_sleep_ratio"]
    results["targets_met"] = {
        "shared_no_preemptions_where_static_preempts":
            results["shared"]["preemptions"] == 0 and results["static"]["preemptions"] > 0,
        "resident_after_idle_le_10pct": results["resident_after_idle_ratio"] <= 0.10,
        "resident_after_sleep_le_5pct": results["resident_after_sleep_ratio"] <= 0.05,
    }
    table = markdown(results)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(results, args.out / "elastic_cpu.png")
        write_results(args.out, "elastic_cpu", results, table)
    print(json.dumps({k: v for k, v in results.items() if k not in ("shared", "static")} | {
        mode: {k: v for k, v in results[mode].items() if k != "resident_samples"} for mode in ("shared", "static")},
        indent=1) if args.json else table)
    return results


if __name__ == "__main__":
    main()
