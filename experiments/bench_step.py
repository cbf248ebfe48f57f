"""One engine decode step against the bare model forward on the same packed batch.

For each model and batch size, an engine decodes ``B`` requests (seeded random prompts); each timed
step is matched by the *bare forward*: the same model weights on the same packed ``[1, B]`` tokens and
positions, attending to contiguous per-layer K/V tensors ``[B, Hk, longest, D]`` (made and filled
just before each forward; ``--bare-cache persistent``: made once and kept across steps, as the
engine's are) with one masked SDPA call per layer (GQA folded into the query dimension) — no manager, no scheduler, no sampler, no
cache writes beyond the new tokens. Engine overhead = (step - bare forward) / step.

Variants, each timed on its own engine, alternating step by step so machine drift hits all alike:
``vmem`` (batched decode over slot runs), ``vmem-per-seq`` (one SDPA call per sequence, the old
path), ``paged`` (block tables: gather into a padded tensor + one call), ``paged-per-seq``.

    python experiments/bench_step.py                         # tiny-llama and smollm2-135m shape
    python experiments/bench_step.py --models tiny-llama --batch-sizes 1 8 32 --steps 10
    python experiments/bench_step.py --models tiny-llama --variants vmem     # the engine alone
    python experiments/bench_step.py --models tiny-llama --batch-sizes 1 8 32 64 --steps 30 \
        --layouts token_major per_layer      # every variant under each KV layout (vmem@per_layer, ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from vmemkv.attention import BlockTableAttention, ContiguousAttention
from vmemkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmemkv.engine.models.zoo import load_model

BARE = "vmemkv_bench_bare"
VARIANTS = ("vmem", "vmem-per-seq", "paged", "paged-per-seq")


class BareBatch:
    """Contiguous K/V per layer for ``B`` decoding sequences of ``lengths`` cached tokens.

    ``capacity`` (tokens per sequence): the tensors are made once that long and kept across
    steps (``advance`` moves the lengths on), as long-lived as the engine's
    (``--bare-cache persistent``); without it they are made for this step alone and filled just
    before the forward (the default, as recorded: the fill leaves K/V warm and pushes weights
    out of the CPU cache, so the two baselines differ by a few percent either way)."""

    def __init__(self, lengths: list[int], num_layers: int, kv_heads: int, head_dim: int, dtype,
                 capacity: int | None = None):
        size = capacity or max(lengths) + 1
        self.cache = [(torch.randn(len(lengths), kv_heads, size, head_dim, dtype=dtype),
                       torch.randn(len(lengths), kv_heads, size, head_dim, dtype=dtype))
                      for _ in range(num_layers)]
        self.rows = torch.arange(len(lengths))
        self.advance(lengths)

    def advance(self, lengths: list[int]) -> None:
        """This step's cached lengths: the new tokens go at ``lengths``, reads stop after them."""
        longest = max(lengths) + 1
        positions = torch.tensor(lengths)
        self.positions = positions
        self.mask = (torch.arange(longest) <= positions[:, None])[:, None, None, :]
        self.longest = longest

    def __call__(self, layer, query, key, value, scaling):
        k, v = self.cache[layer]
        k, v = k[:, :, :self.longest], v[:, :, :self.longest]
        batch, kv_heads, _, head_dim = k.shape
        k[self.rows, :, self.positions] = key[0].transpose(0, 1)  # the new tokens, [B, Hk, D]
        v[self.rows, :, self.positions] = value[0].transpose(0, 1)
        heads = query.shape[1]
        q = query[0].transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scaling)
        return out.reshape(1, batch, heads, head_dim)


def _bare_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    return kwargs["bench_batch"](module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(BARE, _bare_attention)
AttentionMaskInterface.register(BARE, lambda *a, **k: None)


def make_engine(model_name: str, variant: str, batch: int, max_len: int) -> LLMEngine:
    """``variant``: one of VARIANTS, optionally ``@layout`` (the KV layout of that engine)."""
    variant, _, layout = variant.partition("@")
    layout_field = {"layout": layout} if layout else {}
    engine = LLMEngine(EngineConfig(model=model_name, max_num_seqs=max(batch, 1), max_model_len=max_len,
                                    attention="sdpa", kv_backend="paged" if "paged" in variant else "vmem",
                                    **layout_field),
                       stream=False)
    if variant == "vmem-per-seq":  # the path before batching: no slot reads, one call per sequence
        engine.addressing.attention = lambda spans: ContiguousAttention(
            spans, engine.manager.kv_views, engine.runner.device)
    elif variant == "paged-per-seq":
        class PerSequence(BlockTableAttention):
            def plan_batches(self):
                return []
        engine.addressing.attention = lambda spans: PerSequence(
            spans, engine.manager.block_views, engine.manager.tokens_per_page, engine.runner.device)
    return engine


def decoding(engine: LLMEngine) -> bool:
    running = engine.scheduler.running
    return not engine.scheduler.waiting and all(s.num_computed == len(s.token_ids) - 1 for s in running)


def variant_names(layouts: list[str], variants: list[str] = VARIANTS) -> list[str]:
    """Every variant under each layout asked for (``vmem@per_layer``), or plain names for the
    engine's default layout."""
    return [f"{v}@{layout}" if layout else v for layout in layouts or [""] for v in variants]


def bench(model_name: str, batch: int, steps: int, prompt_len: tuple[int, int], seed: int,
          names: list[str], bare_cache: str = "fresh") -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len[0], prompt_len[1] + 1, (batch,), generator=gen).tolist()
    prompts = [torch.randint(1, 250, (n,), generator=gen).tolist() for n in lengths]
    max_len = max(lengths) + steps + 16
    engines = {v: make_engine(model_name, v, batch, max_len) for v in names}
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while not decoding(engine):
            engine.step()
        engine.step()  # one warm decode step
    model, _ = load_model(model_name, seed=0)
    model.set_attn_implementation(BARE)
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    times: dict[str, list[float]] = {v: [] for v in (*names, "bare")}
    # This thread's CPU time too: with one torch thread, and lookahead mapping inline on CPU, a
    # step's work is all on this thread, and time the scheduler gave other processes is left out;
    # with more torch threads the process's CPU time (summed over its threads) instead.
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
    cpu_times: dict[str, list[float]] = {v: [] for v in (*names, "bare")}
    bare = None
    for _ in range(steps):
        seqs = sorted(engines[names[0]].scheduler.running, key=lambda s: int(s.seq_id))
        cached = [s.num_computed for s in seqs]
        ids = torch.tensor([[s.token_ids[-1] for s in seqs]])
        if bare_cache == "fresh" or bare is None:
            bare = BareBatch(cached, text.num_hidden_layers, text.num_key_value_heads, head_dim,
                             next(model.parameters()).dtype,
                             None if bare_cache == "fresh" else max_len + 1)
        else:
            bare.advance(cached)
        with torch.inference_mode():
            start, start_cpu = time.perf_counter(), cpu_clock()
            model(input_ids=ids, position_ids=torch.tensor([cached]), use_cache=False, bench_batch=bare)
            times["bare"].append(time.perf_counter() - start)
            cpu_times["bare"].append(cpu_clock() - start_cpu)
        for variant, engine in engines.items():
            start, start_cpu = time.perf_counter(), cpu_clock()
            engine.step()
            times[variant].append(time.perf_counter() - start)
            cpu_times[variant].append(cpu_clock() - start_cpu)
    stats = {v: engines[v].stats() for v in names}
    for engine in engines.values():
        engine.close()
    median = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    # On a shared machine the fastest step is the least disturbed one: overhead from minimums too.
    fastest = {k: min(t) * 1e3 for k, t in times.items()}
    result = {"model": model_name, "batch": batch, "steps": steps, "bare_cache": bare_cache,
              "mean_cached_len": sum(cached) / batch,
              "ms": median, "overhead": {v: (median[v] - median["bare"]) / median[v] for v in names},
              "min_ms": fastest,
              "overhead_of_min": {v: (fastest[v] - fastest["bare"]) / fastest[v] for v in names},
              "paired_overhead": {v: _paired_overhead(times[v], times["bare"]) for v in names},
              "cpu_ms": {k: statistics.median(t) * 1e3 for k, t in cpu_times.items()},
              "cpu_paired_overhead": {v: _paired_overhead(cpu_times[v], cpu_times["bare"]) for v in names},
              "attention_share": {v: stats[v]["attention_seconds"] / stats[v]["step_seconds"] for v in names},
              "copy_ms_per_step": {v: stats[v]["attention_copy_seconds"] / stats[v]["num_steps"] * 1e3
                                   for v in names},
              "map_ms_per_step": {v: {"inline": stats[v]["inline_map_seconds"] / stats[v]["num_steps"] * 1e3,
                                      "background": stats[v]["background_map_seconds"] / stats[v]["num_steps"] * 1e3}
                                  for v in names}}
    print(json.dumps(result), flush=True)
    return result


def _paired_overhead(step: list[float], bare: list[float]) -> float:
    """Median of (step i - the bare forward timed just before it) over the median step: drift and
    load that last longer than one step cancel."""
    return statistics.median(s - b for s, b in zip(step, bare)) / statistics.median(step)


def markdown(results: list[dict], command: str, load: tuple) -> str:
    names = list(results[0]["overhead"])
    vmem = [n for n in names if n.partition("@")[0] == "vmem"]
    paged = [n for n in names if n.partition("@")[0] == "paged"]
    header = (["model", "B", "bare", *names]
              + [f"{n} {what}" for n in vmem
                 for what in ("overhead", "overhead of min", "paired overhead", "CPU-time paired overhead",
                              "map ms")]
              + [f"{n} copy ms" for n in paged])
    lines = [f"`{command}` — one torch thread, load before {load[0]:.2f}; step and bare forward in ms "
             "(median over steps), overhead = (step - bare) / step, of the medians and of the fastest "
             "steps (the least disturbed on a shared machine), paired (median of step i - the bare "
             "forward timed just before it, over the median step) in wall time and in this thread's "
             "CPU time (other processes' turns left out); map ms per step inline / lookahead "
             "(on the worker on a GPU, on the step thread on CPU)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        ms, maps = r["ms"], r["map_ms_per_step"]
        cells = ([r["model"], str(r["batch"]), f"{ms['bare']:.2f}"] + [f"{ms[v]:.2f}" for v in names]
                 + [cell for n in vmem for cell in (
                     f"{r['overhead'][n]:.0%}", f"{r['overhead_of_min'][n]:.0%}",
                     f"{r['paired_overhead'][n]:.0%}", f"{r['cpu_paired_overhead'][n]:.0%}",
                     f"{maps[n]['inline']:.3f} / {maps[n]['background']:.3f}")]
                 + [f"{r['copy_ms_per_step'][n]:.2f}" for n in paged])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", choices=["token_major", "per_layer"],
                        help="run every variant under each KV layout, side by side (default: the "
                             "engine's default layout only)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="the engines to time against the bare forward (default: all)")
    parser.add_argument("--bare-cache", choices=["fresh", "persistent"], default="fresh",
                        help="the bare forward's K/V: made and filled just before each forward "
                             "(default, as recorded), or made once and kept across steps like "
                             "the engine's (stricter: no fill before the forward disturbs its cache)")
    parser.add_argument("--out", default="experiments/results/local",
                        help="writes step_cpu.json and step_cpu.md here (untracked by default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    names = variant_names(args.layouts, args.variants)
    results = [bench(m, b, args.steps, (args.min_prompt_len, args.max_prompt_len), args.seed, names,
                     args.bare_cache)
               for m in args.models for b in args.batch_sizes]
    command = "python " + " ".join(sys.argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_cpu.json").write_text(json.dumps({"command": command, "load": load, "results": results}, indent=1))
    (out / "step_cpu.md").write_text(markdown(results, command, load))
    print(markdown(results, command, load))


if __name__ == "__main__":
    main()
