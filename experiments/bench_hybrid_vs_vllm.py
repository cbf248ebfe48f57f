"""A recurrent hybrid against vLLM's CPU build: the same random-weight tiny model (saved once as a
Hugging Face directory both systems load), the same prompts (token ids), greedy, ``ignore_eos``,
the same threads; the two systems alternate, each timed run a process of its own
(``bench_vs_vllm.run_one``).

vLLM 0.32's CPU build runs Granite-4.0-H's Mamba2 layers in float32; its gated delta net (Qwen3-Next,
Qwen3.5) needs bfloat16 and head sizes that are multiples of 32, which the tiny configs' are not, and
tiny-lfm2's config lacks the ``conv_dim`` vLLM reads: those fail at start, with the errors this
script writes down when asked (``--models``).

* ``batch-decode``: 16 prompts of 128 random token ids, 64 new tokens each;
* ``shared-prefix``: 16 prompts sharing 384 tokens, 32 of their own, 32 new tokens each.

    python experiments/bench_hybrid_vs_vllm.py --out experiments/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_vs_vllm import DEFAULT_VLLM_PYTHON, run_one  # noqa: E402
from machine import cpu_flags_note, cpu_model, write_results  # noqa: E402


def workloads(vocab: int) -> dict[str, list]:
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = ids(384)
    return {"batch-decode": [(ids(128), 64) for _ in range(16)],
            "shared-prefix": [(prefix + ids(32), 32) for _ in range(16)]}


def save_model(name: str, directory: Path) -> int:
    from vmemkv.engine.models.zoo import load_model

    model, tokenizer = load_model(name)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model.config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-granite-hybrid", help="vmemkv built-in names, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each pair (alternating)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--out", type=Path, help="write hybrid_vs_vllm_cpu.{md,json} here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vmemkv-hybrid-vs-vllm-"))
    rows = []
    for name in args.models.split(","):
        directory = tmp / name
        vocab = save_model(name, directory)
        for workload, requests in workloads(vocab).items():
            runs: dict[str, list] = {"vmemkv": [], "vllm": []}
            error = ""
            for _ in range(args.repeats):
                for system in ("vmemkv", "vllm"):
                    try:
                        python = Path(sys.executable) if system == "vmemkv" else args.vllm_python
                        runs[system].append(run_one(system, workload, requests, args.threads, str(directory),
                                                    python, tmp, dtype=args.dtype))
                    except subprocess.CalledProcessError:  # the system refused the workload: that is the result
                        error = f"{system} failed: its worker exited with an error (on its stderr)"
                if error:
                    break
            speed = {s: statistics.median(r["tokens_per_s"] for r in runs[s]) if runs[s] else None for s in runs}
            same = (sum(a == b for a, b in zip(runs["vmemkv"][0]["tokens"], runs["vllm"][0]["tokens"]))
                    if runs["vmemkv"] and runs["vllm"] else None)
            rows.append({"model": name, "workload": workload, "dtype": args.dtype, "threads": args.threads,
                         "vmemkv_tokens_per_s": speed["vmemkv"], "vllm_tokens_per_s": speed["vllm"],
                         "same_greedy_tokens": f"{same}/{len(requests)}" if same is not None else None,
                         "error": error})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"# A recurrent hybrid against vLLM's CPU build\n\n`python experiments/bench_hybrid_vs_vllm.py "
             f"{' '.join(sys.argv[1:])}` ({datetime.date.today()}, {cpu_model()} ({cpu_flags_note()}); vllm-cpu "
             f"0.32.0; median of {args.repeats} alternating runs; tok/s of output tokens)\n",
             "| model | workload | dtype | threads | vmemkv tok/s | vLLM tok/s | vmemkv / vLLM | same greedy tokens |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        v, w = r["vmemkv_tokens_per_s"], r["vllm_tokens_per_s"]
        lines.append(f"| {r['model']} | {r['workload']} | {r['dtype']} | {r['threads']} | "
                     f"{f'{v:.1f}' if v else 'failed'} | {f'{w:.1f}' if w else 'failed'} | "
                     f"{f'{v / w:.2f}' if v and w else '-'} | {r['same_greedy_tokens'] or '-'} |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, "hybrid_vs_vllm_cpu", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
