"""Where a warm start of the engine goes: the real model already converted in vmemkv's cache, each
start a fresh process, as a user's would be.

For each start: importing vmemkv, torch and transformers; ``LLM(model=...)`` (loading the weights,
packing them, and on an engine's first start on this machine timing the packed kernels,
``vmemkv/engine/models/kernel_choice.py``); and ``vmemkv generate`` end to end. *first start*
runs with no kept measurements (a fresh ``measured.json``), *later starts* read the ones the
first start kept (``vmemkv/engine/models/machine_cache.py``). Seconds, median of ``--repeats``.

    python experiments/bench_startup.py --repeats 3 --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import cpu_model, write_results  # noqa: E402

MODEL = "smollm2-135m-instruct"
# One process: the import, then LLM(); prints both times as JSON.
START = """
import json, sys, time
start = time.perf_counter()
import torch
from vmemkv import LLM
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], threads=int(sys.argv[2]))
built = time.perf_counter()
print(json.dumps({"import": imported - start, "llm": built - imported,
                  "packed": llm.engine.packed_linears}))
"""


def one_start(cache_file: Path, threads: int) -> dict:
    env = {**os.environ, "VMEMKV_MEASURED_FILE": str(cache_file)}
    out = subprocess.run([sys.executable, "-c", START, MODEL, str(threads)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def one_generate(cache_file: Path, threads: int) -> float:
    env = {**os.environ, "VMEMKV_MEASURED_FILE": str(cache_file)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vmemkv.cli", "generate", "--model", MODEL, "--threads",
                    str(threads), "--chat", "--prompt", "What is the capital of France?"],
                   env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(repeats: int, threads: int) -> dict:
    runs = {"first start": [], "later starts": []}
    generate = {"first start": [], "later starts": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            cache_file = Path(folder) / "measured.json"
            runs["first start"].append(one_start(cache_file, threads))
            runs["later starts"].append(one_start(cache_file, threads))
        with tempfile.TemporaryDirectory() as folder:
            cache_file = Path(folder) / "measured.json"
            generate["first start"].append(one_generate(cache_file, threads))
            generate["later starts"].append(one_generate(cache_file, threads))
    return {case: {"import_s": statistics.median(r["import"] for r in runs[case]),
                   "llm_s": statistics.median(r["llm"] for r in runs[case]),
                   "generate_s": statistics.median(generate[case]),
                   "packed": runs[case][-1]["packed"]} for case in runs}


def markdown(results: dict) -> str:
    lines = [f"# Warm start-up, {MODEL} ({results['cpu']}, {results['threads']} thread(s), "
             f"load {results['load']:.1f}, median of {results['repeats']})", "",
             "`python experiments/bench_startup.py --repeats 3 --out experiments/results`", "",
             "| start | import vmemkv (s) | `LLM(...)` (s) | `vmemkv generate` end to end (s) |",
             "|---|---|---|---|"]
    for case in ("first start", "later starts"):
        row = results["cases"][case]
        lines.append(f"| {case} | {row['import_s']:.2f} | {row['llm_s']:.2f} | {row['generate_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "local")
    args = parser.parse_args()
    results = {"cpu": cpu_model(), "threads": args.threads, "repeats": args.repeats,
               "load": os.getloadavg()[0], "cases": measure(args.repeats, args.threads)}
    print(json.dumps(results, indent=2))
    write_results(args.out, "startup_cpu", results, markdown(results))


if __name__ == "__main__":
    main()
