"""``model.generate()`` with vmemkv's ``VmemkvCache`` vs transformers' ``DynamicCache`` and
``StaticCache``: peak KV bytes, wall time and tokens computed, same model, same inputs, one run.

Scenarios (a random-weight Llama, hidden 256, 4 layers, 8 query / 4 KV heads of dim 32, fp32):

* ``beam``: one prompt of ``--prompt-len`` tokens, ``--new-tokens`` new tokens, ``num_beams`` 4
  and 8. vmemkv runs twice: ``vmemkv`` is the drop-in cache (``model.generate(cache=cache)``:
  generate prefills every beam, then reorders remap pages), ``vmemkv-shared-prompt`` is
  ``cache.generate`` (the prompt is computed once and forked to the beams).
* ``shared_prefix``: ``--calls`` sequential greedy calls of ``--prefix-batch`` prompts each; all
  prompts share a ``--prefix-len`` prefix and differ in ``--suffix-len`` tokens, with 64 and with 8 new tokens per call (on a CPU
  the 64 one-token decode steps cost more than the whole prompt, which hides the prefill saved). Peers: a fresh ``DynamicCache`` per call, a fresh
  ``StaticCache`` per call, and transformers' documented prompt-reuse recipe (prefill the prefix
  once into a ``DynamicCache``, ``copy.deepcopy`` it for every call and repeat it per prompt).

Peak KV bytes: vmemkv = peak pages in use x page bytes (the manager's pool, sampled at every
step and inside every reorder, whose partial-page copies exist next to the old pages); transformers
caches = the bytes of their K/V tensors, sampled after every ``update``/``reorder_cache``. The
``transient`` column adds what exists only during one call: the old tensor next to the new one
while ``torch.cat`` / ``index_select`` builds it (one layer at a time). For the shared prefix the
vmemkv figure also gives ``resident``: pages in use plus the prefix cache's evictable pages, and
the recipe's figure counts the kept prefix cache. Tokens computed = input positions fed to the
model (a forward pre-hook). ``equal`` = same tokens as DynamicCache.

    python experiments/bench_generate.py                 # readable table
    python experiments/bench_generate.py --json          # one JSON object
    python experiments/bench_generate.py --out experiments/results   # generate_cpu.md / .json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vmemkv_transformers import VmemkvCache, cache_kwarg

from machine import write_results  # experiments/machine.py, beside this script

MiB = 1 << 20


# --- measuring transformers' caches ----------------------------------------------------------
def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Measured:
    """Peak bytes of a transformers cache's K/V tensors, sampled after each update/reorder."""

    def _init_measure(self) -> None:
        self.peak_bytes = 0
        self.peak_transient_bytes = 0

    def kv_bytes(self) -> int:
        return sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
                   for layer in self.layers if getattr(layer, "is_initialized", False))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        old_keys, old_values = (layer.keys, layer.values) if layer is not None else (None, None)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        after = self.kv_bytes()
        self.peak_bytes = max(self.peak_bytes, after)
        layer = self.layers[layer_idx]
        transient = after
        if isinstance(old_keys, torch.Tensor) and layer.keys is not old_keys:
            # torch.cat built new K (then V) next to the old one
            transient += max(_tensor_bytes(old_keys), _tensor_bytes(old_values))
        self.peak_transient_bytes = max(self.peak_transient_bytes, transient)
        return out

    def reorder_cache(self, beam_idx):
        before = self.kv_bytes()
        largest = max((max(_tensor_bytes(l.keys), _tensor_bytes(l.values)) for l in self.layers
                       if getattr(l, "is_initialized", False)), default=0)
        super().reorder_cache(beam_idx)  # index_select builds each new tensor next to the old one
        self.peak_transient_bytes = max(self.peak_transient_bytes, before + largest)
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes())


class MeasuredDynamicCache(_Measured, DynamicCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_measure()


class MeasuredStaticCache(_Measured, StaticCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_measure()


class TokenCounter:
    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += ids.numel()


# --- the model and inputs ----------------------------------------------------------------------
def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=4096, initializer_range=0.1,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def tokens(length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def timed(fn, repeats: int):
    """Run ``fn`` ``repeats`` times; returns (last result, median seconds, all seconds). The
    table shows the minimum too: on a shared machine it is the steadier figure."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times), times


# --- scenarios -----------------------------------------------------------------------------------
def bench_beam(model, args, num_beams: int) -> list[dict]:
    ids = tokens(args.prompt_len, 1, args.vocab)
    kw = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens,
          "num_beams": num_beams, "do_sample": False}
    name = cache_kwarg(model)
    counter = TokenCounter(model)
    rows = []

    def with_cache(make):
        def run():
            run.cache = make()
            counter.tokens = 0
            out = model.generate(ids, **kw, **{name: run.cache})
            run.tokens = counter.tokens
            return out
        return run

    dynamic = with_cache(lambda: MeasuredDynamicCache())
    want, seconds, times = timed(dynamic, args.repeats)
    rows.append({"method": "DynamicCache", "seconds": seconds, "times": times,
                 "tokens_computed": dynamic.tokens, "peak_kv_bytes": dynamic.cache.peak_bytes,
                 "peak_transient_bytes": dynamic.cache.peak_transient_bytes, "equal": True})

    static = with_cache(lambda: MeasuredStaticCache(config=model.config,
                                                    max_cache_len=args.prompt_len + args.new_tokens))
    out, seconds, times = timed(static, args.repeats)
    rows.append({"method": "StaticCache", "seconds": seconds, "times": times,
                 "tokens_computed": static.tokens, "peak_kv_bytes": static.cache.peak_bytes,
                 "peak_transient_bytes": static.cache.peak_transient_bytes,
                 "equal": torch.equal(out, want)})

    cache = VmemkvCache.from_model(model, max_batch_size=num_beams,
                                   max_cache_len=args.prompt_len + args.new_tokens)
    for method in ("vmemkv", "vmemkv-shared-prompt"):
        def run(method=method):
            cache.release()
            cache.manager.reset_prefix_cache()  # no hits from the previous repeat
            cache.reset_peak()
            copied = cache.manager.cache_stats().blocks_copied
            counter.tokens = 0
            if method == "vmemkv":
                out = model.generate(ids, **kw, **{name: cache})
            else:
                out = cache.generate(ids, keep=True, **kw)
            run.tokens = counter.tokens
            run.pages_copied = cache.manager.cache_stats().blocks_copied - copied  # this repeat's
            return out
        out, seconds, times = timed(run, args.repeats)
        rows.append({"method": method, "seconds": seconds, "times": times,
                     "tokens_computed": run.tokens,
                     "peak_kv_bytes": cache.peak_kv_bytes,  # every layout group's
                     "peak_transient_bytes": cache.peak_kv_bytes,
                     "peak_pages": cache.peak_pages_in_use, "page_bytes": cache.page_bytes,
                     "pages_copied": run.pages_copied, "equal": torch.equal(out, want)})
        cache.release()
        cache.manager.reset_prefix_cache()
    cache.close()
    counter.handle.remove()
    return [dict(scenario=f"beam{num_beams}", **row) for row in rows]


def bench_shared_prefix(model, args, new_tokens: int) -> list[dict]:
    prefix = tokens(args.prefix_len, 2, args.vocab)
    batch = args.prefix_batch
    prompts = [torch.cat([prefix.expand(batch, -1),
                          torch.cat([tokens(args.suffix_len, 100 + batch * i + j, args.vocab)
                                     for j in range(batch)])], dim=1)
               for i in range(args.calls)]
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    name = cache_kwarg(model)
    counter = TokenCounter(model)
    total = args.prefix_len + args.suffix_len + new_tokens
    rows = []

    def series(make_cache):
        """All calls once, a fresh cache each; returns outputs, per-call peak and transient
        bytes, tokens computed."""
        outs, peaks, transients = [], [], []
        counter.tokens = 0
        for ids in prompts:
            cache = make_cache()
            outs.append(model.generate(ids, **kw, **{name: cache}))
            peaks.append(cache.peak_bytes)
            transients.append(cache.peak_transient_bytes)
        return outs, peaks, transients, counter.tokens

    def record(method, result, seconds, times, want, **extra):
        outs, peaks, transients, computed = result
        rows.append(dict(scenario=f"shared_prefix {args.calls} calls x {batch}, {new_tokens} new",
                         method=method, seconds=seconds, times=times, tokens_computed=computed,
                         peak_kv_bytes=max(peaks), peak_kv_bytes_later_calls=max(peaks[1:], default=0),
                         peak_transient_bytes=max(transients), peak_per_call=peaks,
                         equal=want is None or all(torch.equal(a, b) for a, b in zip(outs, want)), **extra))
        return outs

    result, seconds, times = timed(lambda: series(MeasuredDynamicCache), args.repeats)
    want = record("DynamicCache", result, seconds, times, None)

    result, seconds, times = timed(lambda: series(
        lambda: MeasuredStaticCache(config=model.config, max_cache_len=total)), args.repeats)
    record("StaticCache", result, seconds, times, want)

    def recipe():
        counter.tokens = 0
        kept = MeasuredDynamicCache()
        with torch.no_grad():
            model(input_ids=prefix, use_cache=True, **{name: kept})
        kept_bytes = kept.kv_bytes()
        outs, peaks, transients = [], [], []
        for ids in prompts:
            cache = copy.deepcopy(kept)
            cache.batch_repeat_interleave(batch)
            cache._init_measure()
            cache.peak_bytes = cache.peak_transient_bytes = cache.kv_bytes()
            outs.append(model.generate(ids, **kw, **{name: cache}))
            peaks.append(kept_bytes + cache.peak_bytes)  # the kept prefix cache counts
            transients.append(kept_bytes + cache.peak_transient_bytes)
        return outs, peaks, transients, counter.tokens
    result, seconds, times = timed(recipe, args.repeats)
    record("DynamicCache+deepcopy prefix", result, seconds, times, want)

    cache = VmemkvCache.from_model(model, max_batch_size=batch, max_cache_len=total)

    def vmemkv():
        cache.release()
        cache.manager.reset_prefix_cache()
        counter.tokens = 0
        outs, peaks, residents = [], [], []
        for ids in prompts:
            cache.reset_peak()
            outs.append(cache.generate(ids, keep=True, **kw))
            peaks.append(cache.peak_kv_bytes)
            residents.append((cache.manager.num_blocks_in_use + cache.manager.num_cached_blocks)
                             * cache.page_bytes)  # one layout group: the workloads here are Llama
            cache.release()
        return outs, peaks, peaks, counter.tokens, residents
    (*result, residents), seconds, times = timed(vmemkv, args.repeats)
    record("vmemkv", result, seconds, times, want, resident_bytes=max(residents),
           page_bytes=cache.page_bytes)
    cache.close()
    counter.handle.remove()
    return rows


# --- report --------------------------------------------------------------------------------------
def table(results: dict) -> str:
    cfg = results["config"]
    lines = [
        "# `model.generate()`: VmemkvCache vs DynamicCache / StaticCache (CPU)",
        "",
        (f"{cfg['date']}, transformers {cfg['transformers']}, torch {cfg['torch']}, {cfg['cpus']} CPUs "
        f"(load average {cfg['load_average_1min']:.1f} at the start: times are noisy), "
        f"torch threads {cfg['threads']}, {cfg['repeats']} repeat(s). Model: random Llama, hidden 256, 4 layers, "
        f"8 q / 4 kv heads x 32, fp32; prompt {cfg['prompt_len']} tokens for beams; shared prefix "
        f"{cfg['prefix_len']} + {cfg['suffix_len']} tokens, {cfg['calls']} calls of "
        f"{cfg['prefix_batch']} prompts; "
        f"{cfg['new_tokens']} new tokens for beams. vmemkv page = {cfg['page_bytes'] // 1024} KiB "
        f"({cfg['tokens_per_page']} tokens)."),
        "",
        "| scenario | method | wall s min / median | peak KV MiB | transient MiB | vs Dynamic (peak) | tokens computed | equal |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    base = {}
    for row in results["rows"]:
        if row["method"] == "DynamicCache":
            base[row["scenario"]] = row["peak_kv_bytes"]
        ratio = row["peak_kv_bytes"] / base[row["scenario"]]
        extra = ""
        if "peak_kv_bytes_later_calls" in row:
            extra = f" (calls 2+: {row['peak_kv_bytes_later_calls'] / MiB:.2f})"
        if "resident_bytes" in row:
            extra += f" (+ evictable prefix cache: {row['resident_bytes'] / MiB:.2f})"
        lines.append(
            f"| {row['scenario']} | {row['method']} | {min(row['times']):.2f} / {row['seconds']:.2f} | "
            f"{row['peak_kv_bytes'] / MiB:.2f}{extra} | {row['peak_transient_bytes'] / MiB:.2f} | "
            f"{ratio:.2f}x | {row['tokens_computed']} | {'yes' if row['equal'] else 'NO'} |")
    lines += ["", ("Peak KV: vmemkv = peak pages in use x page bytes (reorder copies included); "
              "transformers caches = bytes of their K/V tensors after each update/reorder. "
              "Transient adds the old tensor that `torch.cat` / `index_select` keeps alive while "
              "building the new one (one layer at a time). Shared prefix: the peak over all calls, "
              "then over calls 2+ (the prefix is cached by then); for vmemkv also pages in use plus "
              "the prefix cache's evictable pages, and for the deepcopy recipe the kept prefix "
              "cache is included. `equal`: the same tokens as DynamicCache."), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=320)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--prefix-batch", type=int, default=2,
                        help="prompts per shared-prefix call (same prefix, other suffixes)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens for beam search")
    parser.add_argument("--prefix-new-tokens", type=int, nargs="+", default=[64, 8],
                        help="new tokens per call in the shared-prefix scenario (one row set each)")
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="write generate_cpu.md and generate_cpu.json here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args)
    probe = VmemkvCache.from_model(model, max_batch_size=1, max_cache_len=16)
    page_bytes, tokens_per_page = probe.page_bytes, probe.manager.tokens_per_page
    probe.close()
    results = {
        "config": {
            "date": datetime.date.today().isoformat(), "transformers": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0], "repeats": args.repeats,
            "prompt_len": args.prompt_len, "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len, "calls": args.calls, "prefix_batch": args.prefix_batch,
            "new_tokens": args.new_tokens,
            "prefix_new_tokens": args.prefix_new_tokens,
            "beams": args.beams, "page_bytes": page_bytes, "tokens_per_page": tokens_per_page,
        },
        "rows": [],
    }
    with torch.no_grad():
        for beams in args.beams:
            results["rows"] += bench_beam(model, args, beams)
        for new_tokens in args.prefix_new_tokens:
            results["rows"] += bench_shared_prefix(model, args, new_tokens)
    text = table(results)
    if args.out:
        write_results(args.out, "generate_cpu", results, text)
    print(json.dumps(results, indent=2) if args.json else text)
    return results


if __name__ == "__main__":
    main()
