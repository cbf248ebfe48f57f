"""What machine a benchmark ran on, and writing its results files (shared by the benchmarks here)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Callable


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(out: Path, stem: str, results, markdown: str) -> None:
    """``out/<stem>.json`` (the results) and ``out/<stem>.md`` (their table), ``out`` made if new."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)


def report_main(stem: str, description: str, report: Callable[[], dict], markdown: Callable[[dict], str],
                argv=None) -> int:
    """The command line of a report computed without timing (``report_*.py``): prints the table
    (or, with ``--json``, the results), and with ``--out DIR`` writes ``DIR/<stem>.md`` and ``.json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help=f"write {stem}.md and {stem}.json here")
    args = parser.parse_args(argv)
    result = report()
    if args.out:
        write_results(args.out, stem, result, markdown(result))
    print(json.dumps(result) if args.json else markdown(result), end="\n" if args.json else "")
    return 0


def add_decode_bench_arguments(parser: argparse.ArgumentParser, stem: str, prompt_tokens: int, rounds: int,
                               steps: int) -> None:
    """The options of a benchmark that decodes on engines taking turns (bench_quantized_kv.py,
    bench_direct_forward.py): the model and its dtype, the requests and their prompts' length and
    seed, the thread counts, the rounds and steps measured, ``--quick`` and where the results go."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny-llama, short prompts, few steps: a smoke run")
    parser.add_argument("--out", type=Path, help=f"write {stem}.md and .json here")
    parser.add_argument("--stem", default=stem)


def finish_bench(script: str, argv, args: argparse.Namespace, measured: dict,
                 markdown: Callable[[dict], str]) -> int:
    """A benchmark's results: the command that ran it, the date and CPU, ``args``, and what it
    ``measured``; prints their table (``markdown``) and, with ``args.out``, writes both files there
    (``write_results``, as ``args.stem``)."""
    results = {
        "command": f"python experiments/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "cpu": cpu_model(), "flags": cpu_flags_note(),
        "args": {**vars(args), "out": str(args.out)}, **measured,
    }
    table = markdown(results)
    print(table)
    if args.out:
        write_results(args.out, args.stem, results, table)
    return 0


def cpu_flags_note() -> str:
    """The CPU flags that decide the speed of float32, bfloat16 and int8 here, those present."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return " ".join(flag for flag in wanted if flag in flags) or "none of " + " ".join(wanted)


def tree_pss_bytes(pid: int) -> int:
    """The proportional set size of process ``pid`` and all its descendants (shared pages split
    among the processes that map them, so a tree's sum counts each page once)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            with open(f"/proc/{current}/task/{current}/children") as f:
                pending += [int(child) for child in f.read().split()]
        except (OSError, StopIteration):
            continue  # ended meanwhile
    return total


class PeakMemory:
    """The peak PSS of process ``pid``'s tree, sampled every ``interval`` seconds on a thread
    from ``start()`` to ``stop()`` (which returns it)."""

    def __init__(self, pid: int, interval: float = 0.25):
        import threading

        self.pid, self.interval, self.peak = pid, interval, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, tree_pss_bytes(self.pid))

    def start(self) -> "PeakMemory":
        self.peak = tree_pss_bytes(self.pid)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def run_with_peak_memory(command: list[str], interval: float = 0.25, **popen) -> int:
    """Run ``command`` to its end (raising ``CalledProcessError`` on failure) and return the peak
    PSS of its process tree, sampled every ``interval`` seconds."""
    import subprocess

    process = subprocess.Popen(command, **popen)
    sampler = PeakMemory(process.pid, interval).start()
    process.wait()
    peak = sampler.stop()
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return peak
