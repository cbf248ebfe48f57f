"""The engine end to end with its packed linear layers' q|k|v and gate|up fused (one GEMM each, the
default) or each projection packed alone: ``bench_vs_vllm.py``'s workloads (default long-context: 4
prompts of ~1,500 tokens, prefix cached, 64 tokens each) on SmolLM2-135M-Instruct's real weights,
fp32, greedy, one process, the two engines alternating. Seconds of the timed ``generate``, and
whether the two engines' tokens are equal.

    python experiments/bench_fused_projections.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workloads", default="long-context")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_vs_vllm import make_workloads, warm_up

    import vmemkv.engine.core.llm_engine as llm_engine
    from vmemkv.engine import LLM, SamplingParams
    from vmemkv.engine.models.hub import ensure_real_model
    from vmemkv.engine.models.packed_linear import pack_linears

    model = str(ensure_real_model("smollm2-135m-instruct"))
    engines = {}
    for name, fuse in (("separate", False), ("fused", True)):  # the engine calls pack_linears by name
        llm_engine.pack_linears = functools.partial(pack_linears, fuse=fuse)
        engines[name] = LLM(model, threads=args.threads, max_model_len=2048, max_num_seqs=32)
    llm_engine.pack_linears = pack_linears
    assert [e.engine.packed_linears.startswith("packed") for e in engines.values()] == [True, True]
    workloads = make_workloads(engines["fused"].engine.tokenizer)

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
        best = {name: min(t) for name, t in times.items()}
        print(f"{workload}: {len(requests)} requests, {sum(n for _, n in requests)} output tokens, "
              f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")
        for name in engines:
            print(f"  {name:8s} best {best[name]:.2f} s  runs " + " ".join(f"{t:.2f}" for t in times[name]))
        print(f"  fused / separate {best['fused'] / best['separate']:.3f}; "
              f"tokens equal: {tokens['fused'] == tokens['separate']}")


if __name__ == "__main__":
    main()
