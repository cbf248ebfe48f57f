"""Where an engine decode step spends its time, per step, on CPU: a phase breakdown and the top
functions of a cProfile run.

The engine decodes ``B`` requests (the prompts of ``bench_step.py``). Two passes over the same
kind of steps, on fresh engines:

1. *phases* (µs per step, medians over the steps, no profiler: each phase's method wrapped by a
   ``perf_counter`` pair): schedule, the attention object's build, the lookahead mapping, the
   model forward (of which the attention calls), postprocess (of which sampling), the outputs, the
   per-step bookkeeping; ``step - model forward`` is what the engine adds around the model.
2. *functions* (cProfile, µs per step of own time, ``tottime``; vmemkv's functions unless
   ``--all-functions``): the profiler slows Python several-fold, so read it for the ranking, the
   phases for the sizes.

    python experiments/profile_step.py --batch-sizes 8 32 --steps 60
    python experiments/profile_step.py --batch-sizes 32 --top 30 --markdown   # a markdown section

Run with ``PYTHONPATH=<tree>`` to profile that tree's vmemkv (before/after comparisons).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_step import decoding, make_engine  # experiments/bench_step.py, beside this script
from vmemkv.engine import SamplingParams

# (label, path to the object from the engine, method name); nested phases after their parents
PHASES = (("schedule", "scheduler", "schedule"),
          ("build attention", "runner.addressing", "attention"),
          ("lookahead", "runner.lookahead", "start"),
          ("model forward", "runner.model_runner", "forward"),
          ("postprocess", "postprocessor", "process"),
          ("  of which sampling", "postprocessor.sampler", "sample"),
          ("outputs", "postprocessor", "outputs"),
          ("record memory", "", "_record_memory"),
          ("gauges", "", "_update_gauges"))


def decoding_engine(model: str, batch: int, steps: int, seed: int):
    """An engine with ``batch`` requests past their prefill and one warm decode step."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (batch,), generator=gen).tolist()
    prompts = [torch.randint(1, 250, (n,), generator=gen).tolist() for n in lengths]
    engine = make_engine(model, "vmem", batch, max(lengths) + steps + 16)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while not decoding(engine):
        engine.step()
    engine.step()
    return engine


def _resolve(engine, path: str):
    target = engine
    for name in filter(None, path.split(".")):
        target = getattr(target, name)
    return target


def phases(model: str, batch: int, steps: int, seed: int) -> dict[str, float]:
    """µs per step of each phase (wrapped methods), the attention calls and the step: medians over
    the steps (a shared machine's stalls land in a few steps), and ``step - model forward`` the
    median of that difference step by step."""
    engine = decoding_engine(model, batch, steps, seed)
    seconds: dict[str, float] = {}

    def wrap(owner, name: str, label: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    for label, path, name in PHASES:
        owner = _resolve(engine, path)
        if owner is not None:
            wrap(owner, name, label)
    per_step: dict[str, list[float]] = {}
    for _ in range(steps):
        seconds.clear()
        attention_before = engine.runner.attention_seconds
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        seconds["  of which attention calls"] = engine.runner.attention_seconds - attention_before
        seconds["step"] = step
        seconds["step - model forward"] = step - seconds.get("model forward", 0.0)
        for label, value in seconds.items():
            per_step.setdefault(label, []).append(value)
    engine.close()
    labels = [label for label, _, _ in PHASES] + ["  of which attention calls", "step", "step - model forward"]
    return {label: statistics.median(per_step.get(label, [0.0])) * 1e6 for label in labels}


def top_functions(model: str, batch: int, steps: int, seed: int, top: int,
                  own_only: bool) -> list[tuple[str, float, float]]:
    """(function, own µs per step, calls per step) of the ``top`` largest own times under cProfile;
    ``own_only``: vmemkv's functions alone (what the engine adds; the model's are the same in both)."""
    engine = decoding_engine(model, batch, steps, seed)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    engine.close()
    rows = []
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(profile).stats.items():
        if own_only and "vmemkv" not in Path(path).parts:
            continue
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}" if line else "~"
        rows.append((f"{where}({name})", own / steps * 1e6, calls / steps))
    rows.sort(key=lambda row: -row[1])
    return rows[:top]


def markdown(batch: int, phase: dict[str, float], functions: list[tuple[str, float, float]]) -> str:
    lines = [f"#### B = {batch}", "", "| phase | µs per step |", "|---|---:|"]
    lines += [f"| {label.strip() if not label.startswith('  ') else '&nbsp;&nbsp;' + label.strip()} "
              f"| {us:.0f} |" for label, us in phase.items()]
    lines += ["", "| function (cProfile own time, µs inflated by the profiler) | µs per step | calls per step |",
              "|---|---:|---:|"]
    lines += [f"| `{name}` | {us:.1f} | {calls:.1f} |" for name, us, calls in functions]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-functions", action="store_true",
                        help="rank every function (torch, transformers), not vmemkv's alone")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"python {' '.join(sys.argv)} - load {os.getloadavg()[0]:.2f}, vmemkv from "
          f"{Path(sys.modules['vmemkv'].__file__).parent}", flush=True)
    for batch in args.batch_sizes:
        phase = phases(args.model, batch, args.steps, args.seed)
        functions = top_functions(args.model, batch, args.steps, args.seed, args.top,
                                  not args.all_functions)
        if args.markdown:
            print(markdown(batch, phase, functions), flush=True)
        else:
            print(f"B = {batch}")
            for label, us in phase.items():
                print(f"  {label:32s} {us:9.1f} us")
            for name, us, calls in functions:
                print(f"  {us:9.1f} us  {calls:6.1f}/step  {name}")
        print(f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
