"""The engine end to end with its packed linear layers' q|k|v and gate|up fused (one GEMM each,
``EngineConfig.fused_projections``) or each projection packed alone (the default):
``bench_vs_vllm.py``'s workloads (default long-context: 4 prompts of ~1,500 tokens, prefix cached,
64 tokens each) on SmolLM2-135M-Instruct's real weights, fp32, greedy, one process, the two engines
alternating. Seconds of the timed ``generate``, and whether the two engines' tokens are equal.
Repeats after the first find the first one's prompts in the prefix cache.

    python experiments/bench_fused_projections.py --threads 1 --repeats 3
    python experiments/bench_fused_projections.py --fresh --workloads batch-decode --repeats 4

``--fresh``: each timed run in a process of its own (after its warm-up), the two alternating, so
no run finds another's prompts cached; output tokens per second of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workloads", default="long-context")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="each timed run in a new process")
    parser.add_argument("--one", choices=["separate", "fused"], help=argparse.SUPPRESS)  # --fresh's child
    args = parser.parse_args()
    if args.fresh:
        return fresh_runs(args)
    sys.path.insert(0, str(HERE))
    from bench_vs_vllm import make_workloads, warm_up

    from vmemkv.engine import LLM, SamplingParams
    from vmemkv.engine.models.hub import ensure_real_model

    model = str(ensure_real_model("smollm2-135m-instruct"))
    engines = {}
    for name, fuse in (("separate", False), ("fused", True)):
        if args.one not in (None, name):
            continue
        engines[name] = LLM(model, threads=args.threads, max_model_len=2048, max_num_seqs=32,
                            fused_projections=fuse)
    assert all(e.engine.packed_linears.startswith("packed") for e in engines.values())
    workloads = make_workloads(next(iter(engines.values())).engine.tokenizer)

    def generate(llm, batch):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in batch]
        outputs = llm.generate([ids for ids, _ in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    for workload in args.workloads.split(","):
        requests = workloads[workload]
        times, tokens = {name: [] for name in engines}, {}
        for name, llm in engines.items():
            generate(llm, warm_up(workload, requests))
        for _ in range(args.repeats):
            for name, llm in engines.items():
                start = time.perf_counter()
                tokens[name] = generate(llm, requests)
                times[name].append(time.perf_counter() - start)
        if args.one:  # one timed run of one engine, for fresh_runs
            print(json.dumps({"tokens_per_s": sum(n for _, n in requests) / times[args.one][0]}))
            return
        best = {name: min(t) for name, t in times.items()}
        print(f"{workload}: {len(requests)} requests, {sum(n for _, n in requests)} output tokens, "
              f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")
        for name in engines:
            print(f"  {name:8s} best {best[name]:.2f} s  runs " + " ".join(f"{t:.2f}" for t in times[name]))
        print(f"  fused / separate {best['fused'] / best['separate']:.3f}; "
              f"tokens equal: {tokens['fused'] == tokens['separate']}")


def fresh_runs(args) -> None:
    """Alternate the two engines, each timed run in a process of its own."""
    for workload in args.workloads.split(","):
        runs: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(args.repeats):
            for name in runs:
                out = subprocess.run([sys.executable, __file__, "--one", name, "--repeats", "1",
                                      "--workloads", workload, "--threads", str(args.threads)],
                                     check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
        print(f"{workload}, {args.threads} thread(s), a process per run, load average "
              f"{os.getloadavg()[0]:.1f}: output tok/s")
        for name, values in runs.items():
            print(f"  {name:8s} " + " ".join(f"{v:.1f}" for v in values))
        pairs = [f / s for f, s in zip(runs["fused"], runs["separate"])]
        print("  fused / separate per pair: " + " ".join(f"{p:.3f}" for p in pairs))


if __name__ == "__main__":
    main()
