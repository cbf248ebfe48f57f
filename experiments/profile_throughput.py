"""Where the offline throughput workload's time goes, in HF static ``generate`` and in the vmemkv
engine, under ``torch.profiler`` (CPU, one torch thread), and what each category allows.

The workload of ``bench_throughput.py`` (tiny-llama: 32 seeded random prompts of 16-128 tokens,
64 new tokens each, greedy, EOS ignored), one system at a time, each on its own model instance
with the same weights. Every top-level torch op is put in one category by the code it ran in
(``record_function`` labels set by hooks and wrappers for this run only; nothing in vmemkv or
transformers is changed):

* **linear** - ``aten::linear`` / matmuls of the projections, MLP and ``lm_head``;
* **attention: SDPA kernel** - the ``scaled_dot_product_attention`` calls;
* **attention: other ops** - the attention function's own index, view, mask and output ops
  (vmemkv: query rows, masks; HF: ``repeat_kv``-style expansion and transposes);
* **KV cache writes and copies** - HF: ``DynamicLayer.update`` (a ``torch.cat`` of the whole
  cache per layer per step); vmemkv: the write into the slot views (``index_put_``) and, for
  block tables, the gathers;
* **masks** - HF: ``create_causal_mask`` (vmemkv builds none);
* **other torch ops in the forward** - embedding, RMSNorm, RoPE, SiLU, residual adds;
* **torch ops outside the forward** - sampling, logits processors, the loop's tensor bookkeeping;
* **Python outside torch ops** - the region's wall time minus its top-level ops (HF's modelling
  and generation code, vmemkv's engine: scheduler, metadata, postprocess), profiler overhead
  included.

Each split into prefill (forwards with more than one new token per sequence, vmemkv: steps with a
prompt chunk) and decode. The profiler adds ~1-3 us per op, so the profiled wall is above the
unprofiled one (both reported); each system is profiled ``--repeats`` times and the run of
median wall time is the one broken down; ratios are of the profiled runs.

Also (``--ab``): the same workload through the engine with vmem slots and with block tables
(``kv_backend="paged"``), unprofiled: attention seconds and the gather copies' seconds per run,
and the most vmem could gain over paged if its attention did no copies (an upper bound).

    PYTHONPATH=. python experiments/profile_throughput.py --ab     # the recorded tables
    PYTHONPATH=. python experiments/profile_throughput.py --layout per_layer --out experiments/results/local/p.md

``experiments/results/throughput_profile_cpu.md`` holds the recorded tables with what they show.
A little over 400 lines: the labels, the attribution, the bounds and the report are one job.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import cache_utils, masking_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import bench_throughput  # beside this script
from bench_throughput import HFGenerateSystem, VmemkvSystem, make_prompts
from vmemkv.attention import BlockTableAttention, ContiguousAttention
from vmemkv.engine import LLM
from vmemkv.engine.models.zoo import model_config

LINEAR_OPS = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm"}
SDPA_OPS = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"}
LABELS = ("forward:prefill", "forward:decode", "attention", "kv_write", "mask")
CATEGORIES = ("linear", "attention: SDPA kernel", "attention: other ops", "KV cache writes and copies",
              "masks", "other torch ops in the forward", "torch ops outside the forward",
              "Python outside torch ops")


# --- labels -------------------------------------------------------------------------------------
def _labelled(function, label: str):
    def run(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    return run


@contextmanager
def patched(owner, name: str, label: str):
    """``owner.name`` (a function, or a class's method) runs inside ``record_function(label)``."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, _labelled(original, label))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def attention_label(key: str):
    """The attention function registered as ``key`` runs inside ``record_function("attention")``
    (a local override of transformers' shared interface, in front of the global one)."""
    ALL_ATTENTION_FUNCTIONS[key] = _labelled(ALL_ATTENTION_FUNCTIONS[key], "attention")
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[key]


@contextmanager
def forward_labels(model, is_prefill):
    """The model's forward runs inside ``forward:prefill`` or ``forward:decode``
    (``is_prefill(args, kwargs)`` decides)."""
    opened = []

    def before(module, args, kwargs):
        ctx = record_function("forward:prefill" if is_prefill(args, kwargs) else "forward:decode")
        ctx.__enter__()
        opened.append(ctx)

    def after(module, args, kwargs, output):
        opened.pop().__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def hf_labels(system: HFGenerateSystem, stack: ExitStack) -> None:
    model = system.model
    stack.enter_context(forward_labels(
        model, lambda args, kwargs: kwargs["input_ids"].shape[1] > 1))
    stack.enter_context(patched(cache_utils.DynamicLayer, "update", "kv_write"))
    stack.enter_context(attention_label("sdpa"))
    module = sys.modules[type(model).__module__]
    stack.enter_context(patched(module, "create_causal_mask", "mask"))


def vmemkv_labels(system: VmemkvSystem, stack: ExitStack) -> None:
    model = system.llm.engine.runner.model_runner.model

    def is_prefill(args, kwargs):
        attention = kwargs["vmemkv_attention"]
        return any(span.num_queries > 1 for span in attention.spans)

    stack.enter_context(forward_labels(model, is_prefill))
    stack.enter_context(attention_label("vmemkv"))
    # the writes into the cache, and block tables' gathers (copies) of K/V for SDPA
    for cls, name in ((ContiguousAttention, "write"), (BlockTableAttention, "write"),
                      (BlockTableAttention, "batch_kv"), (BlockTableAttention, "read")):
        stack.enter_context(patched(cls, name, "kv_write"))


# --- attribution -------------------------------------------------------------------------------------
def categorize(events) -> dict[str, dict[str, float]]:
    """Microseconds per (phase, category) of a profile's events; phase is prefill / decode /
    outside (the forward)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    region_wall: dict[str, float] = defaultdict(float)
    ops_in: dict[str, float] = defaultdict(float)
    for event in events:
        name = event.name
        if name in ("forward:prefill", "forward:decode"):
            region_wall[name.split(":")[1]] += event.time_range.elapsed_us()
            continue
        if name in LABELS or name.startswith("ProfilerStep"):
            continue
        labels, parent, nested = [], event.cpu_parent, False
        while parent is not None:
            if parent.name in LABELS:
                labels.append(parent.name)
            elif not parent.name.startswith("ProfilerStep"):
                nested = True  # inside another op: counted with it
                break
            parent = parent.cpu_parent
        if nested:
            continue
        phase = next((label.split(":")[1] for label in labels if label.startswith("forward:")), "outside")
        us = event.time_range.elapsed_us()
        ops_in[phase] += us
        innermost = labels[0] if labels else None
        if innermost == "kv_write":
            category = "KV cache writes and copies"
        elif innermost == "mask":
            category = "masks"
        elif innermost == "attention":
            category = "attention: SDPA kernel" if name in SDPA_OPS else "attention: other ops"
        elif phase == "outside":
            category = "torch ops outside the forward"
        elif name in LINEAR_OPS:
            category = "linear"
        else:
            category = "other torch ops in the forward"
        totals[phase][category] += us
    for phase in ("prefill", "decode"):
        totals[phase]["Python outside torch ops"] += region_wall[phase] - ops_in[phase]
    totals["_forward_wall"] = dict(region_wall)
    totals["_ops_outside"] = {"outside": ops_in["outside"]}
    return totals


def profile_run(system, label_fn, prompts, new_tokens) -> dict:
    with ExitStack() as stack:
        label_fn(system, stack)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            system.run(prompts, new_tokens)
            wall_us = (time.perf_counter() - start) * 1e6
    totals = categorize(prof.events())
    forward_wall = sum(totals.pop("_forward_wall").values())
    ops_outside = totals.pop("_ops_outside")["outside"]
    totals["outside"]["Python outside torch ops"] += wall_us - forward_wall - ops_outside
    return {"wall_s": wall_us / 1e6,
            "seconds": {phase: {c: totals[phase].get(c, 0.0) / 1e6 for c in CATEGORIES}
                        for phase in ("prefill", "decode", "outside")}}


def unprofiled(system, prompts, new_tokens, repeats: int) -> tuple[float, float | None]:
    """Median wall seconds of ``repeats`` runs without the profiler and, for the engine, the
    median seconds in its model forward (a ``perf_counter`` pair around it: the rest is the
    engine's own work outside the forward, unprofiled)."""
    runner = getattr(getattr(system, "llm", None), "engine", None)
    runner = runner.runner.model_runner if runner is not None else None
    forward, in_forward = runner.forward if runner is not None else None, [0.0]

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - start

    if runner is not None:
        runner.forward = timed_forward
    walls, forwards = [], []
    for _ in range(repeats):
        in_forward[0], start = 0.0, time.perf_counter()
        system.run(prompts, new_tokens)
        walls.append(time.perf_counter() - start)
        forwards.append(in_forward[0])
    if runner is not None:
        del runner.forward
    return statistics.median(walls), statistics.median(forwards) if runner is not None else None


# --- the A/B bound ---------------------------------------------------------------------------------------
def ab_bound(args, prompts, new_tokens) -> dict:
    """vmem slots vs block tables on this workload, unprofiled, alternating: engine step seconds,
    attention seconds and the gather copies' seconds, medians of ``args.repeats`` runs."""
    systems = {}
    for backend in ("vmem", "paged"):
        # bench_throughput's system builds its LLM from a fixed set of fields: hand it one whose
        # KV backend is this one (the A/B's one flag)
        bench_throughput.LLM = functools.partial(LLM, kv_backend=backend)
        try:
            system = VmemkvSystem(args.model, prompts, new_tokens, engine_args(args))
        finally:
            bench_throughput.LLM = LLM
        system.run(prompts[:2], 4)
        systems[backend] = system
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name in (list(systems) if repeat % 2 == 0 else list(systems)[::-1]):
            system = systems[name]
            before = system.llm.engine.stats()
            start, start_cpu = time.perf_counter(), time.thread_time()
            system.run(prompts, new_tokens)
            wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            after = system.llm.engine.stats()
            runs[name].append({"wall_s": wall, "cpu_s": cpu, **{
                key: after[key] - before[key]
                for key in ("step_seconds", "attention_seconds", "attention_copy_seconds")}})
    for system in systems.values():
        system.close()
    return {name: {key: statistics.median(run[key] for run in values) for key in values[0]}
            for name, values in runs.items()}


def ab_json_bounds(path: Path) -> str:
    """From a recorded ``vmemkv ab`` run: per workload, vmem / paged per CPU-second, paged's
    attention share, and the most vmem could gain if paged's attention cost nothing at all
    (copies and kernel: a loose upper bound; the JSON has no copy seconds)."""
    data = json.loads(path.read_text())
    lines = [f"From `{path}` (`{data.get('command', '')}`):", "",
             "| workload | vmem / paged per CPU-s | vmem attention s | paged attention s | paged attention share "
             "| bound: paged's attention free |", "|---|---:|---:|---:|---:|---:|"]
    for workload, variants in data["results"].items():
        if "vmem" not in variants or "paged" not in variants:
            continue
        vmem, paged = variants["vmem"]["metrics"], variants["paged"]["metrics"]
        cpu, attention = paged["cpu_s"]["median"], paged["attention_seconds"]["median"]
        lines.append(f"| {workload} | {vmem['output_tokens_per_cpu_s']['median'] / paged['output_tokens_per_cpu_s']['median']:.2f} "
                     f"| {vmem['attention_seconds']['median']:.3f} | {attention:.3f} "
                     f"| {paged['attention_share']['median']:.0%} | {cpu / (cpu - attention):.2f} |")
    return "\n".join(lines) + "\n"


def engine_args(args) -> SimpleNamespace:
    """bench_throughput's defaults for what its systems read."""
    return SimpleNamespace(max_num_seqs=64, max_model_len=1024, dtype="float32", layout=args.layout,
                           hf_batch_size=0)


# --- report --------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    hf, vm = result["hf_generate"], result["vmemkv"]
    lines = [f"Command: `{result['command']}`; {result['workload']}; one torch thread; load "
             f"{result['load_before']:.2f} before, {result['load_after']:.2f} after.", "",
             f"Unprofiled wall (median of {result['repeats']}): HF {hf['unprofiled_wall_s']:.3f} s, "
             f"vmemkv {vm['unprofiled_wall_s']:.3f} s, ratio **{hf['unprofiled_wall_s'] / vm['unprofiled_wall_s']:.2f}x**. "
             f"Profiled wall (the run of median wall of {len(hf['profiled_walls_s'])}, whose categories "
             f"are below): HF {hf['wall_s']:.3f} s (runs {_seconds(hf['profiled_walls_s'])}), vmemkv "
             f"{vm['wall_s']:.3f} s (runs {_seconds(vm['profiled_walls_s'])}), ratio "
             f"{hf['wall_s'] / vm['wall_s']:.2f}x.", "",
             "| category | phase | HF ms | vmemkv ms | HF - vmemkv ms | ratio HF / vmemkv |",
             "|---|---|---:|---:|---:|---:|"]
    for category in CATEGORIES:
        for phase in ("prefill", "decode", "outside", "all"):
            h, v = (_total(x, category, phase) for x in (hf, vm))
            if phase != "all" and h < 1e-4 and v < 1e-4:
                continue
            ratio = f"{h / v:.2f}" if v > 1e-5 else "-"
            bold = "**" if phase == "all" else ""
            lines.append(f"| {category} | {bold}{phase}{bold} | {h * 1e3:.1f} | {v * 1e3:.1f} | "
                         f"{(h - v) * 1e3:+.1f} | {ratio} |")
    lines.append(f"| **total** | | {hf['wall_s'] * 1e3:.1f} | {vm['wall_s'] * 1e3:.1f} | "
                 f"{(hf['wall_s'] - vm['wall_s']) * 1e3:+.1f} | {hf['wall_s'] / vm['wall_s']:.2f} |")
    return "\n".join(lines) + "\n"


def _seconds(values: list[float]) -> str:
    return " / ".join(f"{value:.3f}" for value in values)


def _total(system: dict, category: str, phase: str) -> float:
    phases = ("prefill", "decode", "outside") if phase == "all" else (phase,)
    return sum(system["seconds"][p][category] for p in phases)


def bounds(result: dict) -> list[tuple[str, float]]:
    """What the categories allow: (what, value) rows for the report; profiled seconds unless
    said (the profiler slows HF, with more ops, more than the engine)."""
    hf, vm = result["hf_generate"], result["vmemkv"]
    hf_wall, vm_wall = hf["wall_s"], vm["wall_s"]
    cells = [(c, p) for c in CATEGORIES for p in ("prefill", "decode", "outside")]
    removed = sum(max(0.0, _total(hf, c, p) - _total(vm, c, p)) for c, p in cells)
    added = sum(max(0.0, _total(vm, c, p) - _total(hf, c, p)) for c, p in cells)
    outside = _total(vm, "Python outside torch ops", "outside") + _total(vm, "torch ops outside the forward", "all")
    python_fwd = sum(_total(vm, "Python outside torch ops", p) for p in ("prefill", "decode"))
    linear, sdpa = _total(vm, "linear", "all"), _total(vm, "attention: SDPA kernel", "all")
    return [
        ("linear, HF / vmemkv, whole run", _total(hf, "linear", "all") / linear),
        ("linear, HF / vmemkv, prefill", _total(hf, "linear", "prefill") / _total(vm, "linear", "prefill")),
        ("linear, HF / vmemkv, decode", _total(hf, "linear", "decode") / _total(vm, "linear", "decode")),
        ("vmemkv now, unprofiled", hf["unprofiled_wall_s"] / vm["unprofiled_wall_s"]),
        ("vmemkv's model forward alone, unprofiled (nothing outside it)",
         hf["unprofiled_wall_s"] / vm["unprofiled_forward_s"]),
        ("vmemkv now (profiled)", hf_wall / vm_wall),
        ("HF's time vmemkv removes, s (categories where HF spends more)", removed),
        ("time vmemkv adds, s (categories where it spends more)", added),
        ("HF minus what vmemkv removes, nothing added: HF / (HF - removed)", hf_wall / (hf_wall - removed)),
        ("vmemkv without its engine work outside the forward (profiled)", hf_wall / (vm_wall - outside)),
        ("vmemkv's torch ops in the forward only (no Python at all)", hf_wall / (vm_wall - outside - python_fwd)),
        ("vmemkv's linear + SDPA only", hf_wall / (linear + sdpa)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="unprofiled runs, and profiled runs, per system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=["token_major", "per_layer"],
                        help="the engine's KV layout (default: its own, token-major)")
    parser.add_argument("--ab", action="store_true", help="also vmem vs block tables on the workload")
    parser.add_argument("--ab-json", type=Path, default=Path("experiments/results/ab/ab.json"),
                        help="a recorded vmemkv ab run to bound vmem's gain over paged from")
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    prompts = make_prompts(model_config(args.model).vocab_size, args.num_prompts, 16, 128, args.seed)
    new = args.max_new_tokens
    result = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "repeats": args.repeats,
              "workload": f"{args.model}, {len(prompts)} prompts of {min(map(len, prompts))}-"
                          f"{max(map(len, prompts))} tokens, {new} new each"}
    for name, cls, label_fn in (("hf_generate", HFGenerateSystem, hf_labels),
                                ("vmemkv", VmemkvSystem, vmemkv_labels)):
        system = cls(args.model, prompts, new, engine_args(args))
        system.run(prompts[:2], 4)  # warm-up
        wall, forward = unprofiled(system, prompts, new, args.repeats)
        # a single profiled run can catch a slow spell (HF's cache cats vary 4x between runs
        # here): profile each system `repeats` times and keep the run of median wall time
        profiled = sorted((profile_run(system, label_fn, prompts, new) for _ in range(args.repeats)),
                          key=lambda run: run["wall_s"])
        result[name] = profiled[len(profiled) // 2]
        result[name]["unprofiled_wall_s"], result[name]["unprofiled_forward_s"] = wall, forward
        result[name]["profiled_walls_s"] = [run["wall_s"] for run in profiled]
        system.close()
        print(f"{name}: unprofiled {wall:.3f} s, profiled {result[name]['wall_s']:.3f} s "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    text = markdown(result)
    text += ("\n| what HF / vmemkv would be (or seconds) | value |\n|---|---:|\n"
             + "".join(f"| {what} | {value:.2f} |\n" for what, value in bounds(result)))
    if args.ab:
        ab = ab_bound(args, prompts, new)
        text += "\n| backend | wall s | CPU s | step s | attention s | copy s |\n|---|---:|---:|---:|---:|---:|\n"
        text += "".join(f"| {name} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['step_seconds']:.3f} | "
                        f"{r['attention_seconds']:.3f} | {r['attention_copy_seconds']:.3f} |\n"
                        for name, r in ab.items())
        paged = ab["paged"]
        text += (f"\n- paged / vmem CPU s: {paged['cpu_s'] / ab['vmem']['cpu_s']:.3f}\n"
                 f"- bound if paged's copies were free: {paged['cpu_s'] / (paged['cpu_s'] - paged['attention_copy_seconds']):.3f}\n"
                 f"- bound if paged's whole attention were free: {paged['cpu_s'] / (paged['cpu_s'] - paged['attention_seconds']):.3f}\n")
    if args.ab_json and args.ab_json.exists():
        text += "\n" + ab_json_bounds(args.ab_json)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
