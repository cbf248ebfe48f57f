"""Runs one workload on one KV variant and measures it; runs the whole A/B (variants alternating).

The engine is driven directly: every request is added at once (an offline batch), then
``engine.step()`` is called until none is left, and each completion's token count is timestamped
after every step. Latencies therefore include queueing behind the batch (TTFT of the last
admitted request is long by design); the same schedule hits every variant alike.

Everything comes from the engine's ``stats()``, which includes what the library itself timed
(``vmemkv.KVMetricsCollector``, which the engine passes to its KV cache manager and backend): the
manager's operations (admission, growth, commit, free, fork, preemption, block tables, ...) and
the backend's map/unmap calls, split into inline (on the step thread) and background (the
lookahead worker, overlapped with the forward pass).
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from dataclasses import dataclass

import torch

from vmemkv.engine.core.config import EngineConfig
from vmemkv.engine.core.llm_engine import LLMEngine
from vmemkv.engine.core.metrics import percentile
from vmemkv.engine.models.zoo import load_model
from vmemkv.engine.core.sampling_params import SamplingParams
from vmemkv.ab.variants import REFERENCE_VARIANT, VARIANTS, Variant, check_variants
from vmemkv.ab.workloads import Workload, make_workload


# Every run's metrics dict has exactly these keys (all numbers).
METRIC_KEYS = (
    "wall_s", "cpu_s", "num_requests", "output_tokens", "requests_per_s", "output_tokens_per_s",
    "output_tokens_per_cpu_s",
    "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
    "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms",
    "itl_mean_ms", "itl_p50_ms", "itl_p99_ms",
    "peak_kv_bytes", "peak_kv_mib", "peak_kv_bytes_per_request", "kv_bytes_per_token_per_layer",
    "most_running", "requests_fit",
    "internal_fragmentation", "prefix_hit_rate",
    "prefix_hit_rate_host", "host_demotions", "host_promotions",
    "prefix_hit_rate_cold", "cold_demotions", "cold_promotions",
    "preemptions", "preemptions_swap", "preemptions_recompute", "evictions", "forks", "blocks_copied",
    "map_calls", "unmap_calls", "pages_mapped", "map_calls_saved",
    "backend_map_seconds", "backend_unmap_seconds", "map_background_seconds", "map_wait_seconds",
    "map_hidden_seconds", "inline_map_seconds", "manager_seconds",
    "num_steps", "tokens_computed", "step_seconds", "attention_seconds",
    "attention_share", "mapping_share", "mapping_share_engine", "kv_manager_share",
)

@dataclass
class RunResult:
    workload: str
    variant: str
    repeat: int
    metrics: dict[str, float]
    # request id -> token ids of each completion (index order)
    tokens: dict[str, list[list[int]]]
    tokens_per_page: int = 0  # the engine's real page (manager.tokens_per_page)
    attention: str = ""  # the attention that ran (engine.attention_kernel)


def engine_config(model_name: str, workload: Workload, variant: Variant, seed: int,
                  device: str = "cpu", tokens_per_page: int | None = None,
                  overrides: dict | None = None) -> EngineConfig:
    """``tokens_per_page``: the variant's real page, when known (the workload's pool is scaled to
    it if the workload was sized for another); ``overrides``: more EngineConfig fields."""
    engine = workload.engine if tokens_per_page is None else workload.engine_for(tokens_per_page)
    overrides = dict(overrides or {})
    fields = variant.engine_fields(overrides.pop("kv_cold_cache_bytes", 0))  # a lossy variant's alone
    return EngineConfig(model=model_name, seed=seed, device=device, **engine, **fields, **overrides)


def run_once(model, tokenizer, model_name: str, workload: Workload, variant: Variant,
             seed: int = 0, repeat: int = 0, device: str = "cpu",
             tokens_per_page: int | None = None, overrides: dict | None = None) -> RunResult:
    """A fresh engine (fresh KV manager and pool) on the shared model, the workload run once.
    Under tensor parallelism (``overrides["tensor_parallel_size"] > 1``) every rank loads the
    model by name, its own shard, so the engine loads rank 0's too: the same weights (the same
    name and seed) and tokenizer as ``model``, ``tokenizer``."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the ranks load it so too
    config = engine_config(model_name, workload, variant, seed, device, tokens_per_page,
                           {"dtype": dtype, **(overrides or {})})
    engine = (LLMEngine(config) if config.tensor_parallel_size > 1
              else LLMEngine(config, model, tokenizer))
    try:
        page_tokens = engine.manager.tokens_per_page
        cache = engine.manager.config  # the whole model's, also for a hybrid model's two groups
        pool_bytes = cache.num_blocks * cache.make_layout().block_bytes
        gc.collect()
        token_times: dict[tuple[str, int], list[float]] = {}
        finished: dict[str, object] = {}
        per_request = PeakPerRequest()
        start, cpu_start = time.perf_counter(), time.process_time()
        for request_id, prompt, params in workload.requests:
            engine.add_request(request_id, list(prompt), params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            per_request.sample(engine)
            for output in outputs:
                if output.error:
                    raise RuntimeError(f"{workload.name}/{variant.name}: request "
                                       f"{output.request_id} failed: {output.error}")
                for completion in output.outputs:
                    times = token_times.setdefault((output.request_id, completion.index), [])
                    times += [now] * (len(completion.token_ids) - len(times))
                if output.finished:
                    finished[output.request_id] = output
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        stats = engine.stats()
        attention = engine.attention_kernel
    finally:
        engine.close()
    tokens = {rid: [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)]
              for rid, out in finished.items()}
    metrics = _metrics(workload, stats, token_times, start, wall, cpu)
    metrics.update(peak_kv_bytes_per_request=per_request.kv_bytes, most_running=per_request.running,
                   requests_fit=pool_bytes // per_request.kv_bytes if per_request.kv_bytes else 0.0)
    return RunResult(workload.name, variant.name, repeat, metrics, tokens, page_tokens, attention)


def _metrics(workload: Workload, stats: dict,
             token_times: dict[tuple[str, int], list[float]], start: float, wall: float,
             cpu: float) -> dict:
    first_by_request: dict[str, float] = {}
    tpot, itl = [], []
    for (request_id, _), times in token_times.items():
        if not times:
            continue
        first_by_request[request_id] = min(first_by_request.get(request_id, times[0]), times[0])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl += [b - a for a, b in itertools.pairwise(times)]
    ttft = [t - start for t in first_by_request.values()]
    output_tokens = sum(len(times) for times in token_times.values())
    step = stats["step_seconds"] or float("nan")
    m: dict[str, float] = {
        "wall_s": wall, "cpu_s": cpu, "num_requests": len(workload.requests),
        "output_tokens": output_tokens, "requests_per_s": len(workload.requests) / wall,
        "output_tokens_per_s": output_tokens / wall,
        # CPU seconds of this process (all its threads): less sensitive than wall time to other
        # processes competing for the cores
        "output_tokens_per_cpu_s": output_tokens / cpu if cpu > 0 else float("nan"),
    }
    for name, samples in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        m.update(_describe_ms(name, samples))
    for key in ("peak_kv_bytes", "kv_bytes_per_token_per_layer", "internal_fragmentation",
                "prefix_hit_rate", "host_demotions",
                "host_promotions", "cold_demotions", "cold_promotions", "preemptions",
                "preemptions_swap", "preemptions_recompute", "evictions", "forks", "blocks_copied",
                "map_calls", "unmap_calls", "pages_mapped", "map_calls_saved",
                "backend_map_seconds", "backend_unmap_seconds", "map_background_seconds",
                "map_wait_seconds", "map_hidden_seconds", "num_steps", "tokens_computed", "step_seconds",
                "attention_seconds"):
        m[key] = float(stats.get(key, 0.0))
    m["peak_kv_mib"] = m["peak_kv_bytes"] / 2**20
    m["peak_kv_bytes_per_request"] = m["most_running"] = m["requests_fit"] = 0.0  # run_once samples them
    # prompt tokens served from the host tier (promoted), a part of prefix_hit_rate
    queried = stats.get("prefix_queried_tokens", 0)
    m["prefix_hit_rate_host"] = stats.get("prefix_hit_tokens_host", 0) / queried if queried else 0.0
    # and from the cold tier (decompressed: lossy)
    m["prefix_hit_rate_cold"] = stats.get("prefix_hit_tokens_cold", 0) / queried if queried else 0.0
    # From the library's collector: backend map/unmap on the step thread, and the manager's
    # operations (outermost calls; inline mapping inside them included).
    m["inline_map_seconds"] = float(stats["inline_map_seconds"])
    m["manager_seconds"] = float(stats["manager_seconds"])
    m["attention_share"] = m["attention_seconds"] / step
    # Mapping the step waited for: backend map/unmap on the step thread, plus waiting for the
    # lookahead worker at the end of the forward pass.
    m["mapping_share"] = (m["inline_map_seconds"] + m["map_wait_seconds"]) / step
    # The engine-only estimate (what stats() alone gives): backend mapping not hidden by the
    # worker. A lower bound: map_hidden_seconds counts the worker's whole job, not just its
    # backend calls, so it can exceed the backend time (then this reads 0).
    m["mapping_share_engine"] = max(m["backend_map_seconds"] - m["map_hidden_seconds"], 0.0) / step
    # All KV-manager time on the step's critical path (inline mapping included).
    m["kv_manager_share"] = (m["manager_seconds"] + m["map_wait_seconds"]) / step
    assert set(m) == set(METRIC_KEYS), set(m) ^ set(METRIC_KEYS)
    return m


class PeakPerRequest:
    """The most KV bytes the running requests held per request, and the most requests running,
    sampled after every step (a sliding-window model's requests hold about a window each). The
    pool's bytes over the first: ``requests_fit``, how many such requests the pool holds."""

    def __init__(self) -> None:
        self.kv_bytes = self.running = 0.0

    def sample(self, engine: LLMEngine) -> None:
        running = len(engine.scheduler.running)
        if running:
            self.kv_bytes = max(self.kv_bytes, engine.manager.kv_bytes_in_use / running)
            self.running = max(self.running, float(running))


def _describe_ms(name: str, samples: list[float]) -> dict[str, float]:
    if not samples:
        nan = float("nan")
        return {f"{name}_mean_ms": nan, f"{name}_p50_ms": nan, f"{name}_p99_ms": nan}
    samples = sorted(samples)
    return {f"{name}_mean_ms": 1e3 * sum(samples) / len(samples),
            f"{name}_p50_ms": 1e3 * percentile(samples, 50),
            f"{name}_p99_ms": 1e3 * percentile(samples, 99)}


# --- the whole A/B ---------------------------------------------------------------------------------
def _warmup_workload() -> Workload:
    requests = [("warmup-0", list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                 ignore_eos=True)),
                ("warmup-1", list(range(40, 90)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True))]
    return Workload("warmup", "two short requests", requests,
                    {"max_num_seqs": 4, "max_model_len": 256, "num_blocks": 32})


def rotated(variants: list[str], repeat: int) -> list[str]:
    """Repeat r runs the variants in order, rotated left by r (vmem, paged, vmem-per-layer,
    paged-per-layer; then paged, vmem-per-layer, paged-per-layer, vmem; ...) so no variant always
    goes first or last."""
    shift = repeat % len(variants)
    return variants[shift:] + variants[:shift]


def workload_page(page_tokens: dict[str, int]) -> int:
    """The page the workloads are sized for: the reference variant's (vmem and paged share it),
    else the coarsest of the variants run."""
    return page_tokens.get(REFERENCE_VARIANT) or max(page_tokens.values())


def run_experiment(workloads: list[str], variants: list[str], repeats: int = 3, quick: bool = False,
                   model_name: str = "tiny-llama", seed: int = 0, threads: int | None = 1,
                   progress: bool = True, device: str = "cpu",
                   tokens_per_page: int | None = None, policy: str = "fcfs",
                   host_cache_bytes: int = 0, tensor_parallel_size: int = 1,
                   cold_cache_bytes: int = 64 << 20) -> dict:
    """Every workload on every variant, ``repeats`` times, variants alternating; returns the
    results dict that ``report`` formats (medians with min-max, checks, raw runs).

    The workloads are sized for the engine's real page, read from each variant's warmup engine
    (``tokens_per_page`` only asks for one: EngineConfig.tokens_per_page). ``policy`` (the
    scheduling policy), ``host_cache_bytes`` (the prefix cache's host tier; 0: none) and
    ``tensor_parallel_size`` (ranks the model and its KV heads are split across) are the
    EngineConfig fields of the same names, the same for every variant, so the A/B still compares
    only the addressing."""
    from tqdm.auto import tqdm

    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    for name in workloads:
        make_workload(name, seed, quick)  # unknown names fail before the model loads
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    overrides = {"policy": policy, "host_cache_bytes": host_cache_bytes,
                 "tensor_parallel_size": tensor_parallel_size, "kv_cold_cache_bytes": cold_cache_bytes}
    if tokens_per_page is not None:
        overrides["tokens_per_page"] = tokens_per_page
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    began = time.perf_counter()
    try:
        model, tokenizer = load_model(model_name, seed=seed, device=device)
        for name in workloads:
            make_workload(name, seed, quick).check_model(model)
        check_variants(variants, model.config, model_name)
        warmup = _warmup_workload()
        total = len(variants) * (1 + len(workloads) * repeats)
        runs: list[RunResult] = []
        page_tokens: dict[str, int] = {}
        with tqdm(total=total, desc="vmemkv ab", unit="run", disable=not progress) as bar:
            for name in variants:  # once per variant: kernels, allocator, native mapper warm
                bar.set_postfix_str(f"warmup {name}")
                page_tokens[name] = run_once(model, tokenizer, model_name, warmup, VARIANTS[name],
                                             seed, device=device, overrides=overrides).tokens_per_page
                bar.update(1)
            page = workload_page(page_tokens)
            # the text workloads (chat-real) go through the model's own tokenizer
            built = {name: make_workload(name, seed, quick, page, tokenizer=tokenizer)
                     for name in workloads}
            for workload in built.values():
                for repeat in range(repeats):
                    for name in rotated(variants, repeat):
                        bar.set_postfix_str(f"{workload.name} {name} #{repeat + 1}")
                        runs.append(run_once(model, tokenizer, model_name, workload,
                                             VARIANTS[name], seed, repeat, device,
                                             page_tokens[name], overrides))
                        bar.update(1)
    finally:
        torch.set_num_threads(previous_threads)
    return summarize(built, variants, runs, time.perf_counter() - began,
                     {"workloads": workloads, "variants": variants, "repeats": repeats,
                      "quick": quick, "model": model_name, "seed": seed, "device": device,
                      "policy": policy, "host_cache_bytes": host_cache_bytes,
                      "tensor_parallel_size": tensor_parallel_size, "cold_cache_bytes": cold_cache_bytes,
                      "torch_threads": threads or previous_threads,
                      "tokens_per_page": page_tokens, "workload_tokens_per_page": page})


def summarize(workloads: dict[str, Workload], variants: list[str], runs: list[RunResult],
              runtime_s: float, config: dict) -> dict:
    config = {**config, "attention": ", ".join(sorted({run.attention for run in runs if run.attention}))}
    results: dict[str, dict] = {}
    checks: dict[str, dict] = {}
    for name, workload in workloads.items():
        per_variant = {}
        reference = [r for r in runs if r.workload == name and r.variant == REFERENCE_VARIANT]
        for variant in variants:
            mine = [r for r in runs if r.workload == name and r.variant == variant]
            equal = identical = None
            if reference and variant != REFERENCE_VARIANT:
                equal = all(a.tokens == b.tokens for a, b in zip(reference, mine))
                first, own = reference[0].tokens, mine[0].tokens  # requests answered alike, repeat 1
                identical = [sum(own[rid] == first[rid] for rid in first), len(first)]
            elif reference:  # the reference against itself: the same tokens every repeat
                equal = all(r.tokens == reference[0].tokens for r in reference)
            per_variant[variant] = {
                "metrics": {key: _spread([r.metrics[key] for r in mine]) for key in METRIC_KEYS},
                "tokens_equal": equal,
                "requests_identical": identical,
                "runs": [r.metrics for r in mine],
            }
        results[name] = per_variant
        check = {"greedy": workload.greedy}
        if REFERENCE_VARIANT in per_variant:
            check["tokens_equal"] = {v: per_variant[v]["tokens_equal"] for v in variants
                                     if v != REFERENCE_VARIANT}
        if workload.expect_preemption:
            check["preemptions_min"] = min(r.metrics["preemptions"] for r in runs if r.workload == name)
        other_pages = {r.variant: r.tokens_per_page for r in runs
                       if r.workload == name and r.tokens_per_page != workload.tokens_per_page}
        if other_pages:  # e.g. per-layer on CUDA: 2 MiB holds 8x the tokens of a token-major page
            check["other_page_size"] = other_pages
        checks[name] = check
    return {"config": config, "variants": {v: vars(VARIANTS[v]) for v in variants},
            "workloads": {name: w.describe() for name, w in workloads.items()},
            "results": results, "checks": checks, "failures": failures(workloads, results, checks),
            "runtime_s": runtime_s}


def failures(workloads: dict[str, Workload], results: dict, checks: dict | None = None) -> list[str]:
    """What the run must not show: differing greedy tokens, a pressure workload that never
    preempted, a sliding-window workload that preempted (its pool holds every request only with
    release behind the window) or whose pool fits every request at a keep-every-block variant's
    peak KV per request (``requests_fit``: then the pool shows nothing release saves), vmem and
    paged disagreeing on the prefix hit rate. A variant whose pages hold other than the
    workload's tokens per page (``checks[name]["other_page_size"]``) is held to neither pressure
    check: the pool was sized in the workload's pages (and pages as large as the window release
    nothing)."""
    problems = []
    for name, workload in workloads.items():
        per_variant = results[name]
        if workload.greedy:
            for variant, result in per_variant.items():
                if result["tokens_equal"] is False and not VARIANTS[variant].lossy:
                    problems.append(f"{name}: {variant} gave different greedy tokens from "
                                    f"{REFERENCE_VARIANT}")
        if workload.expect_preemption:
            other_pages = (checks or {}).get(name, {}).get("other_page_size", {})
            for variant, result in per_variant.items():
                if variant not in other_pages and result["metrics"]["preemptions"]["min"] <= 0:
                    problems.append(f"{name}: {variant} never preempted; shrink num_blocks")
        if workload.sliding_window is not None:
            other_pages = (checks or {}).get(name, {}).get("other_page_size", {})
            for variant, result in per_variant.items():
                if variant in other_pages:
                    continue
                metrics = result["metrics"]
                if VARIANTS[variant].release and metrics["preemptions"]["max"] > 0:
                    problems.append(f"{name}: {variant} preempted: the pool holds every request "
                                    "only if blocks behind the window go back to it")
                if not VARIANTS[variant].release and metrics["requests_fit"]["max"] >= len(workload.requests):
                    problems.append(f"{name}: {variant} fits every request keeping every block: "
                                    "the pool is too large to show what release saves")
        if "vmem" in per_variant and "paged" in per_variant:
            a = per_variant["vmem"]["metrics"]["prefix_hit_rate"]["median"]
            b = per_variant["paged"]["metrics"]["prefix_hit_rate"]["median"]
            if abs(a - b) > 1e-9:
                problems.append(f"{name}: prefix hit rate vmem {a:.4f} != paged {b:.4f}")
    return problems


def _spread(values: list[float]) -> dict[str, float]:
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan}
    return {"median": statistics.median(clean), "min": min(clean), "max": max(clean)}
