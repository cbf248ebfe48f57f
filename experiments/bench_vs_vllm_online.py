"""vmemkv's server against vLLM's, measured by vLLM's own serving benchmark client.

Each system serves SmolLM2-135M-Instruct's real weights in the same dtype (``--dtype``: float32
and bfloat16 by default) at its defaults on one port, with the same thread count: ``vmemkv serve
--threads N``; vLLM's OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) with ``VLLM_CPU_OMP_THREADS_BIND`` = ``0`` or ``0-1`` for its
worker (its engine core and front end are processes of their own). Then
``vllm.benchmarks.serve`` (``add_cli_args``, ``main``; run in vLLM's venv: its CLI entry point
fails on package metadata) sends the same requests to each: greedy, ``--ignore-eos``, on its
``random`` (256 tokens in, 64 out) and ``prefix_repetition`` (4 prefixes of 512 tokens, 64-token
suffixes, 32 out) datasets, 48 requests, at a few request rates (``inf``: all at once, capped by
``--max-concurrency 16``), each rate with its own seed so no run finds the last one's prefixes
cached. Reported: request throughput, TTFT, TPOT and ITL at p50 and p99. With ``--repeats N`` the
two servers take turns N times (a fresh server each turn, the same requests): on a shared 2-core
VM one system's request throughput varied 2.0-2.35 req/s from run to run, so the tables show the
median of each metric and the ratios the median and range of the turns' ratios. Each server's
peak memory (PSS of its process tree while it served, model included) is in the table too.

    python experiments/bench_vs_vllm_online.py --out experiments/results              # 1 and 2 threads
    python experiments/bench_vs_vllm_online.py --threads 1 --rates inf --datasets random
    python experiments/bench_vs_vllm_online.py --threads 1,2 --rates inf --repeats 3 --out experiments/results
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", "/work/vllm_venv/bin/python"))
SERVED_NAME = "smollm2"
DATASETS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "32"],
}
METRICS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "completed")
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(system: str, model: str, port: int, threads: int, vllm_python: Path,
                   dtype: str = "float32") -> tuple[list, dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if system == "vmemkv":
        return ([sys.executable, "-m", "vmemkv.cli", "serve", "--model", model, "--served-model-name",
                 SERVED_NAME, "--port", str(port), "--threads", str(threads), "--max-model-len", "2048",
                 "--dtype", dtype], env)
    env.update(VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    return ([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", dtype,
             "--max-model-len", "2048", "--enable-prefix-caching", "--seed", "0"], env)


@contextmanager
def serving(system: str, model: str, threads: int, vllm_python: Path, log: Path, timeout_s: float = 600,
            dtype: str = "float32", memory: dict | None = None):
    """Start the server, wait until ``/v1/models`` answers, yield its base URL, stop it; the peak
    PSS of its process tree until then goes into ``memory["peak_bytes"]``."""
    from machine import PeakMemory

    port = free_port()
    command, env = server_command(system, model, port, threads, vllm_python, dtype)
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    sampler = PeakMemory(process.pid).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{system} server exited with {process.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{system} server not ready after {timeout_s:.0f} s; see {log}")
                time.sleep(1)
        yield url
    finally:
        if memory is not None:
            memory["peak_bytes"] = sampler.peak
        sampler.stop()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_client(vllm_python: Path, url: str, model: str, dataset: str, rate: str, seed: int,
               num_prompts: int, tmp: Path, label: str) -> dict:
    result = tmp / f"{label}.json"
    result.unlink(missing_ok=True)
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
            "--tokenizer", model, *DATASETS[dataset], "--num-prompts", str(num_prompts),
            "--request-rate", rate, "--max-concurrency", "16", "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(tmp), "--result-filename", result.name, "--disable-tqdm"]
    subprocess.run([str(vllm_python), "-c", CLIENT, *args], check=True, cwd=tmp,
                   stdout=subprocess.DEVNULL)
    raw = json.loads(result.read_text())
    return {name: raw.get(name) for name in METRICS}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r.get("dtype", "float32"), r["threads"], r["dataset"], r["rate"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for system, offset in (("vmemkv", -0.2), ("vllm", 0.2)):
        by = {(r.get("dtype", "float32"), r["threads"], r["dataset"], r["rate"]): r for r in rows
              if r["system"] == system}
        xs = [i + offset for i in range(len(labels))]
        axes[0].bar(xs, [by[k]["request_throughput"] for k in labels], width=0.4, label=system)
        axes[1].bar(xs, [by[k]["median_tpot_ms"] for k in labels], width=0.4, label=system)
    for axis, title in zip(axes, ("requests/s (higher is better)", "TPOT p50, ms (lower is better)")):
        axis.set_xticks(range(len(labels)), [f"{dt} {t}t\n{d} rate {r}" for dt, t, d, r in labels], fontsize=6)
        axis.set_title(title)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cell(row: dict) -> tuple:
    """What a row measured, but the system: (dtype, threads, dataset, rate)."""
    return row.get("dtype", "float32"), row["threads"], row["dataset"], row["rate"]


def medians(rows: list[dict]) -> list[dict]:
    """One row per (dtype, threads, dataset, rate, system): each metric's median over the turns."""
    keys = sorted(dict.fromkeys((*cell(r), r["system"]) for r in rows),
                  key=lambda k: (k[0], k[1], k[4] != "vmemkv"))  # stable: datasets and rates in run order
    out = []
    for dtype, threads, dataset, rate, system in keys:
        runs = [r for r in rows if (*cell(r), r["system"]) == (dtype, threads, dataset, rate, system)]
        measured = [name for name in (*METRICS, "peak_memory_bytes") if all(name in r for r in runs)]
        out.append({"dtype": dtype, "threads": threads, "dataset": dataset, "rate": rate, "system": system,
                    "runs": len(runs), **{name: statistics.median(r[name] for r in runs) for name in measured}})
    return out


def turn_ratios(rows: list[dict]) -> dict[tuple, list[float]]:
    """vmemkv's request throughput over vLLM's in each turn, by (dtype, threads, dataset, rate)."""
    ratios: dict[tuple, list[float]] = {}
    for r in rows:
        if r["system"] != "vmemkv":
            continue
        peer = next(p for p in rows if p["system"] == "vllm" and cell(p) == cell(r)
                    and p.get("repeat", 0) == r.get("repeat", 0))
        ratios.setdefault(cell(r), []).append(r["request_throughput"] / peer["request_throughput"])
    return ratios


def report(rows: list[dict], load_before: float, num_prompts: int, repeats: int,
           command: str) -> tuple[dict, str]:
    sys.path.insert(0, str(HERE))
    from machine import cpu_flags_note, cpu_model

    table = medians(rows)
    ratios = turn_ratios(rows)
    results = {"cpu": cpu_model(), "cpu_flags": cpu_flags_note(), "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d"),
               "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
               "model": "smollm2-135m-instruct", "vllm": "vllm-cpu 0.32.0", "client": "vllm.benchmarks.serve",
               "num_prompts": num_prompts, "max_concurrency": 16, "repeats": repeats, "rows": rows,
               "medians": table, "ratios": {"-".join(map(str, key)): v for key, v in ratios.items()}}
    turns = (f"the servers took {repeats} turns each, alternating; each cell the median over the turns"
             if repeats > 1 else "one run each")
    lines = ["# vmemkv's server against vLLM's, with vLLM's serving benchmark client", "",
             f"`{command}` ({results['date']}, "
             f"{results['cpu']} ({results['cpu_flags']}), {results['cpus']} CPUs, load average "
             f"{load_before:.1f} before, {results['load_average_after']:.1f} after; {results['model']}; "
             f"{num_prompts} requests per run, greedy, `--ignore-eos`, `--max-concurrency 16`; " + turns +
             "). Each server at its defaults but the threads and the dtype: vmemkv `serve --threads N` (one "
             "process); vLLM `VLLM_CPU_OMP_THREADS_BIND` `0` or `0-1` (its engine core and API server "
             "processes of their own), `VLLM_CPU_KVCACHE_SPACE=1`. Peak MiB: the largest PSS of the "
             "server's process tree while it served (model included).", "",
             "| dtype | threads | dataset | rate (req/s) | system | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "ITL p50 / p99 ms | completed | peak MiB |", "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        memory = f"{r['peak_memory_bytes'] / 2**20:,.0f}" if "peak_memory_bytes" in r else ""
        lines.append(f"| {r['dtype']} | {r['threads']} | {r['dataset']} | {r['rate']} | {r['system']} | "
                     f"{r['request_throughput']:.2f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | "
                     f"{r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {r['completed']:.0f} | {memory} |")
    if ratios:
        parts = []
        for (dtype, threads, dataset, rate), values in ratios.items():
            spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
            parts.append(f"{dtype}, {threads} thread(s), {dataset}, rate {rate}: "
                         f"{statistics.median(values):.2f}x{spread}")
        what = "median of the turns' ratios (their range)" if repeats > 1 else "one run each"
        lines += ["", f"vmemkv's request throughput over vLLM's ({what}): " + "; ".join(parts) + "."]
    return results, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="dtypes both servers run, comma-separated, of float32, bfloat16")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--rates", default="inf,1", help="request rates (req/s), comma-separated")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="turns of the two servers (alternating)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--out", type=Path, help="write vs_vllm_online_cpu.{json,md,png} here")
    args = parser.parse_args()
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM venv at {args.vllm_python}: make one as bench_vs_vllm.py --install does")
    sys.path.insert(0, str(HERE))
    from machine import write_results
    from vmemkv.engine.models.hub import ensure_real_model

    model = str(ensure_real_model("smollm2-135m-instruct"))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "vmemkv-vs-vllm-online"
    tmp.mkdir(exist_ok=True)
    rows, load_before = [], os.getloadavg()[0]
    for dtype, threads in [(d, int(t)) for d in args.dtype.split(",") for t in args.threads.split(",")]:
        for repeat in range(args.repeats):
            for system in ("vmemkv", "vllm"):
                served, memory = [], {}
                with serving(system, model, threads, args.vllm_python, tmp / f"{system}-{threads}-{dtype}.log",
                             dtype=dtype, memory=memory) as url:
                    for dataset in args.datasets.split(","):
                        for seed, rate in enumerate(args.rates.split(",")):
                            label = f"{system}-{threads}-{dtype}-{dataset}-{rate}"
                            metrics = run_client(args.vllm_python, url, model, dataset, rate, seed,
                                                 args.num_prompts, tmp, label)
                            served.append({"dtype": dtype, "threads": threads, "dataset": dataset, "rate": rate,
                                           "system": system, "repeat": repeat, **metrics})
                            print(json.dumps(served[-1]), flush=True)
                rows += [{**row, "peak_memory_bytes": memory["peak_bytes"]} for row in served]
    command = "python experiments/bench_vs_vllm_online.py " + " ".join(sys.argv[1:])
    results, markdown = report(rows, load_before, args.num_prompts, args.repeats, command)
    print(markdown)
    if args.out:
        write_results(args.out, "vs_vllm_online_cpu", results, markdown)
        plot(results["medians"], args.out / "vs_vllm_online_cpu.png")


if __name__ == "__main__":
    main()
