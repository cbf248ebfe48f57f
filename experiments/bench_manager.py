"""What the KV cache manager's operations cost, in µs, with 1,000 live requests, and its prefix
hit rate on a shared-prefix trace next to a plain block-table reference.

Operations (median over many calls, each timed alone with ``perf_counter_ns``; the untimed
bookkeeping around them — commit, free of the probe request — is done between samples):

* ``admit_hit``: a prompt whose system prompt (4 blocks) is cached, plus one block of new tokens;
* ``admit_cold``: a prompt of 5 blocks of fresh tokens;
* ``append_cross``: a decode append that crosses a block boundary (one new block, mapped);
* ``append``: a decode append inside the last block (no mapping), the request named by its id and
  the token passed along (``allocate(id, 1, [token])``);
* ``append_by_object``: the same through the request's ``KVRequest``, as the engine does: the
  caller appends the token to its list (untimed: a list append), then ``allocate(request, 1)``;
* ``commit_full_page``: the commit after the append that fills a block (hash + register);
  ``commit_full_page_by_object`` the same for a request driven by object, which also checks the
  block's token ids (the caller appended them; by id they were checked at each append);
* ``fork``: fork of a request with a partial last block (one block copied);
* ``free``: free of such a forked request;
* ``preempt_swap`` / ``swap_in``: swap a request's private blocks to host memory and back.

``--hybrid`` runs the same operations on a model of two layer groups, as Gemma-2 (one layer of
full attention, one of a ``--window`` sliding window, drawing from one shared pool of the same
bytes), to set against the one-group run (two full-attention layers): every operation then plans,
checks and carries out its work in both groups.

The trace: groups of requests share system prompts of different lengths, with random suffixes and
decodes, finishing in random order under memory pressure; the manager's prefix hit rate is
compared with ``ReferenceBlockTable`` (a dict of chained block keys -> block, the same tokens per
block, the same LRU eviction), which must give the same rate.

    python experiments/bench_manager.py                 # readable table
    python experiments/bench_manager.py --json          # one JSON object
    python experiments/bench_manager.py --out experiments/results   # manager_cpu.md / .json
    python experiments/bench_manager.py --hybrid --out experiments/results   # manager_hybrid_cpu.*
    python experiments/bench_manager.py --compare --out experiments/results  # manager_group_compare_cpu.*
"""

from __future__ import annotations

import argparse
import datetime
import gc
import heapq
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from vmemkv import CacheConfig, KVCacheManager  # noqa: E402
from machine import cpu_model, write_results  # experiments/machine.py, beside this script

TARGETS_US = {"append_cross": 10.0, "append": 2.0}
OPS = ("admit_hit", "admit_cold", "append_cross", "append", "append_by_object", "commit_full_page",
       "commit_full_page_by_object", "fork", "free", "preempt_swap", "swap_in")


# --- a plain block-table manager: the reference for the hit rate -----------------------------------


class ReferenceBlockTable:
    """Prefix caching as block-table engines do it, in a few obviously-correct lines: full blocks
    keyed by their whole prefix (exact chained keys, no hash function), ref counts, clean blocks
    handed out lowest id first, then cached blocks least recently freed first; a request's blocks
    are freed deepest first; at least one prompt token is always computed."""

    def __init__(self, num_blocks: int, tokens_per_page: int):
        self.tpp = tokens_per_page
        self.ref = [0] * num_blocks
        self.clean = list(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.block_of: dict[int, int] = {}  # page key -> block
        self.key_of: dict[int, int] = {}  # block -> page key
        self.keys: dict[tuple, int] = {}  # (parent key, page tokens) -> page key
        self.requests: dict[str, dict] = {}
        self.queried = self.hit = 0

    def page_keys(self, tokens: list[int]) -> list[int]:
        keys, parent = [], -1
        for start in range(0, len(tokens) - self.tpp + 1, self.tpp):
            parent = self.keys.setdefault((parent, tuple(tokens[start:start + self.tpp])), len(self.keys))
            keys.append(parent)
        return keys

    def _take(self, n: int) -> list[int]:
        blocks = [heapq.heappop(self.clean) for _ in range(min(n, len(self.clean)))]
        while len(blocks) < n:
            block, _ = self.lru.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            blocks.append(block)
        for block in blocks:
            self.ref[block] = 1
        return blocks

    def admit(self, request_id: str, tokens: list[int]) -> int | None:
        keys = self.page_keys(tokens)
        hits = []
        for key in keys[: (len(tokens) - 1) // self.tpp]:
            if key not in self.block_of:
                break
            hits.append(self.block_of[key])
        needed = -(-len(tokens) // self.tpp) - len(hits)
        if needed > len(self.clean) + len(self.lru) - sum(self.ref[b] == 0 for b in hits):
            return None
        for block in hits:
            if self.ref[block] == 0:
                del self.lru[block]
            self.ref[block] += 1
        self.queried += len(tokens)
        self.hit += len(hits) * self.tpp
        self.requests[request_id] = {"tokens": list(tokens), "blocks": hits + self._take(needed),
                                     "registered": len(hits)}
        self._register(request_id)
        return len(hits) * self.tpp

    def append(self, request_id: str, token: int) -> bool:
        req = self.requests[request_id]
        if len(req["tokens"]) % self.tpp == 0:
            if not self.clean and not self.lru:
                return False
            req["blocks"] += self._take(1)
        req["tokens"].append(token)
        self._register(request_id)
        return True

    def _register(self, request_id: str) -> None:
        req = self.requests[request_id]
        full = len(req["tokens"]) // self.tpp
        if full > req["registered"]:
            keys = self.page_keys(req["tokens"])
            for index in range(req["registered"], full):
                block = req["blocks"][index]
                if block not in self.key_of and keys[index] not in self.block_of:
                    self.key_of[block], self.block_of[keys[index]] = keys[index], block
            req["registered"] = full

    def free(self, request_id: str) -> None:
        for block in reversed(self.requests.pop(request_id)["blocks"]):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.key_of:
                    self.lru[block] = None
                else:
                    heapq.heappush(self.clean, block)

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0


# --- operation costs ---------------------------------------------------------------------------------


class Timer:
    def __init__(self):
        self.samples: dict[str, list[int]] = {op: [] for op in OPS}

    def time(self, op: str, fn, *args):
        start = time.perf_counter_ns()
        result = fn(*args)
        self.samples[op].append(time.perf_counter_ns() - start)
        return result

    def summary(self) -> dict:
        out = {}
        for op, ns in self.samples.items():
            if ns:
                ordered = sorted(ns)
                out[op] = {"median_us": statistics.median(ns) / 1e3,
                           "p90_us": ordered[int(0.9 * (len(ordered) - 1))] / 1e3,
                           "mean_us": statistics.fmean(ns) / 1e3, "n": len(ns)}
        return out


def measure_ops(args, run: int, hybrid: bool | None = None) -> tuple[dict, Timer, list[float], list[float]]:
    """One run on a fresh manager: (facts about it, the samples, the append_cross split in ns)."""
    steps = operation_steps(args, run, args.hybrid if hybrid is None else hybrid)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def operation_steps(args, run: int, hybrid: bool):
    """``measure_ops`` as a generator that pauses after each request's decode and each probe, so
    ``--compare`` can alternate two managers' samples; it returns what ``measure_ops`` does."""
    rng = random.Random(args.seed + run)
    tpp = args.tokens_per_page
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                         tokens_per_page=tpp, num_blocks=args.num_blocks,
                         max_num_seqs=args.live + 64, max_model_len=args.max_model_len,
                         swap_space_bytes=64 * 2 * 2 * 2 * 64 * 2 * tpp)
    timer = Timer()
    fresh = iter(range(10**6, 10**9))  # token ids never seen before
    systems = [[next(fresh) for _ in range(4 * tpp)] for _ in range(8)]  # 4-page system prompts

    def new_prompt(cold: bool) -> list[int]:
        head = [next(fresh) for _ in range(4 * tpp)] if cold else list(rng.choice(systems))
        return head + [next(fresh) for _ in range(rng.randrange(1, tpp))]

    # --hybrid: layer 0 slides, layer 1 has full attention: two groups of one layer, whose blocks
    # have the same bytes, so one shared pool of 2 x num_blocks one-layer blocks (the same bytes)
    groups = dict(layer_windows=[args.window, None]) if hybrid else {}
    with KVCacheManager(config, **groups) as m:
        ids = [f"live{i}" for i in range(args.live)]
        for i, request_id in enumerate(ids):  # the background: 1,000 live requests
            # the first ones hold every system prompt, so admit_hit always hits 4 pages
            prompt = systems[i] + [next(fresh)] if i < len(systems) else new_prompt(rng.random() < 0.5)
            m.admit(request_id, prompt)
            m.commit(request_id)
        gc.collect()
        gc.disable()  # as timeit does: no collector pauses inside the samples
        try:
            in_map: list[float] = []  # ns in the native map call, per crossing append
            outside_map: list[float] = []  # ns of the rest: the manager's and backend's Python
            requests = [m.request(request_id) for request_id in ids]
            for round_ in range(args.rounds):
                # decode: appends inside the page, the crossing one, the commit that fills a page;
                # every other request named by its KVRequest rather than its id
                for index, request_id in enumerate(ids):
                    req = requests[index]
                    while True:
                        crossing = m.num_tokens(request_id) % tpp == 0
                        before = m.backend.stats.map_seconds
                        if index % 2 and not crossing:
                            req.token_ids.append(next(fresh))
                            ok = timer.time("append_by_object", m.allocate, req, 1)
                        else:
                            ok = timer.time("append_cross" if crossing else "append", m.allocate,
                                            request_id, 1, [next(fresh)])
                        if crossing:
                            native = m.backend.stats.map_seconds - before
                            in_map.append(native * 1e9)
                            outside_map.append(timer.samples["append_cross"][-1] - native * 1e9)
                        assert ok, "pool too small for the benchmark; raise --num-blocks"
                        if m.num_tokens(request_id) % tpp == 0:
                            if index % 2:  # the block's ids were appended by the caller: checked now
                                timer.time("commit_full_page_by_object", m.commit, req)
                            else:
                                timer.time("commit_full_page", m.commit, request_id)
                        else:
                            m.commit(request_id)
                        if crossing:
                            break
                    yield
                # admission with and without a cached prefix, fork and free, swap out and in
                for i in range(args.probes):
                    probe = f"probe{round_}.{i}"
                    cold = i % 2 == 1
                    cached = timer.time("admit_cold" if cold else "admit_hit", m.admit, probe,
                                        new_prompt(cold))
                    assert cached == (0 if cold else 4 * tpp), cached
                    m.commit(probe)
                    m.free(probe)
                    parent = rng.choice(ids)
                    if m.num_tokens(parent) % tpp == 0:  # fork of a partial page: one copy
                        m.allocate(parent, 1, [next(fresh)])
                        m.commit(parent)
                    assert timer.time("fork", m.fork, parent, probe)
                    timer.time("free", m.free, probe)
                    victim = rng.choice(ids)
                    timer.time("preempt_swap", m.preempt, victim, "swap")
                    assert timer.time("swap_in", m.swap_in, victim)
                    yield
        finally:
            gc.enable()
        m.check()
        stats = m.snapshot_stats()
        out = {
            "live_requests": args.live, "slots": config.max_num_seqs,
            "blocks": args.num_blocks, "blocks_in_use_at_end": stats["blocks_in_use"],
            "page_bytes": m.layout.page_size, "tokens_per_page": tpp,
            "max_model_len": args.max_model_len, "layout": m.layout.kind,
            "layer_groups": [group.spec.describe() for group in m.layout_groups],
            "pool_blocks": [memory.pool.num_blocks for memory in m.memories],
            "backend_mappings_at_end": getattr(m.backend, "mappings_in_use", None),
        }
    return out, timer, in_map, outside_map


def measure_all_ops(args) -> dict:
    """``--repeat`` runs; each operation's statistics over all samples, plus each run's median
    (the best of them discounts other tenants of a shared machine)."""
    timers, in_map, outside_map = [], [], []
    for run in range(args.repeat):
        out, timer, run_in_map, run_outside_map = measure_ops(args, run)
        timers.append(timer)
        in_map += run_in_map
        outside_map += run_outside_map
    combined = Timer()
    for timer in timers:
        for op, ns in timer.samples.items():
            combined.samples[op] += ns
    ops = combined.summary()
    for op, summary in ops.items():
        run_medians = [statistics.median(t.samples[op]) / 1e3 for t in timers if t.samples[op]]
        summary["run_medians_us"] = run_medians
        summary["best_run_median_us"] = min(run_medians)
    out["ops"] = ops
    out["repeat"] = args.repeat
    # append_cross split: the backend's native map call (the mmap system call), and the rest
    # (the manager's and the backend's Python), medians in µs
    out["append_cross_native_map_median_us"] = statistics.median(in_map) / 1e3
    out["append_cross_outside_map_median_us"] = statistics.median(outside_map) / 1e3
    return out


def compare_groups(args) -> dict:
    """``--compare``: the one-group and the two-group manager in one process, their runs stepped
    alternately (one request's decode or one probe each), so both see the same machine load; per
    operation the two medians and their ratio. Runs in separate processes differ by up to 40 %
    on a shared VM, more than the ratio being measured."""
    ratios: dict[str, list[float]] = {op: [] for op in OPS}
    medians: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}
    splits = []
    for run in range(args.repeat):
        runs = [operation_steps(args, run, hybrid) for hybrid in (False, True)]
        results = [None, None]
        while None in results:
            for index, steps in enumerate(runs):
                if results[index] is None:
                    try:
                        next(steps)
                    except StopIteration as done:
                        results[index] = done.value
        for op in OPS:
            one, two = (statistics.median(timer.samples[op]) / 1e3 for _, timer, _, _ in results)
            medians[op].append((one, two))
            ratios[op].append(two / one)
        splits.append([(statistics.median(in_map) / 1e3, statistics.median(outside) / 1e3)
                       for _, _, in_map, outside in results])
    out = {"repeat": args.repeat, "window": args.window, "live_requests": args.live,
           "tokens_per_page": args.tokens_per_page, "ops": {}}
    for op in OPS:
        out["ops"][op] = {"one_group_us": [one for one, _ in medians[op]],
                          "two_groups_us": [two for _, two in medians[op]],
                          "ratios": ratios[op], "median_ratio": statistics.median(ratios[op])}
    out["append_cross_split_us"] = {
        "one_group": {"native_map": statistics.median(s[0][0] for s in splits),
                      "outside": statistics.median(s[0][1] for s in splits)},
        "two_groups": {"native_map": statistics.median(s[1][0] for s in splits),
                       "outside": statistics.median(s[1][1] for s in splits)}}
    return out


def compare_markdown(r: dict, c: dict) -> str:
    lines = [
        "# KV cache manager: two layer groups against one, stepped alternately in one process",
        "",
        (f"`python experiments/bench_manager.py --compare` ({r['date']}, {r['cpu']}, {r['cpus']} CPUs, "
         f"load average {r['load_average_1min']:.2f} at the start and {r['load_average_1min_end']:.2f} "
         f"at the end, torch threads {r['torch_threads']}). One group: two full-attention layers; two "
         f"groups: one full-attention and one sliding-window ({c['window']}) layer in one shared pool "
         f"of the same bytes. {c['live_requests']} live requests each; {c['repeat']} runs, each a "
         "fresh pair of managers whose samples alternate (one request's decode or one probe each)."),
        "",
        "| operation | one group µs | two groups µs | ratio | ratio per run |",
        "|---|---:|---:|---:|---|",
    ]
    for op in OPS:
        o = c["ops"][op]
        lines.append(f"| {op} | {statistics.median(o['one_group_us']):.1f} | "
                     f"{statistics.median(o['two_groups_us']):.1f} | {o['median_ratio']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in o['ratios'])} |")
    split = c["append_cross_split_us"]
    lines += ["", ("`append_cross` split (medians, one group / two groups): "
                   f"{split['one_group']['native_map']:.1f} / {split['two_groups']['native_map']:.1f} µs "
                   "in the native map call (one `mmap` per group: each group's own virtual tensors), "
                   f"{split['one_group']['outside']:.1f} / {split['two_groups']['outside']:.1f} µs outside it.")]
    return "\n".join(lines) + "\n"


# --- the shared-prefix trace ---------------------------------------------------------------------


def run_trace(args) -> dict:
    rng = random.Random(args.seed + 1)
    tpp = args.tokens_per_page
    config = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                         tokens_per_page=tpp, num_blocks=args.trace_blocks,
                         max_num_seqs=args.trace_live + 1, max_model_len=1024)
    reference = ReferenceBlockTable(args.trace_blocks, tpp)
    vocab = 32000
    # system prompts of different lengths (not page multiples), popularity skewed
    lengths = [7, 16, 40, 64, 100, 150, 256, 333]
    systems = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    weights = [1 / (rank + 1) for rank in range(len(systems))]
    live: list[str] = []
    mismatches = refused = 0
    with KVCacheManager(config) as m:
        def finish_one() -> None:
            request_id = live.pop(rng.randrange(len(live)))
            m.free(request_id)
            reference.free(request_id)

        for n in range(args.trace_requests):
            request_id = f"t{n}"
            system = rng.choices(range(len(systems)), weights)[0]
            prompt = systems[system] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 64))]
            while True:
                if len(live) >= args.trace_live:
                    finish_one()
                    continue
                cached = m.admit(request_id, prompt)
                expected = reference.admit(request_id, prompt)
                mismatches += cached != expected
                if cached is not None:
                    break
                refused += 1
                if expected is not None:
                    reference.free(request_id)
                finish_one()
            m.commit(request_id)
            live.append(request_id)
            for _ in range(rng.randrange(0, 48)):  # decode some tokens
                token = rng.randrange(vocab)
                ok = m.allocate(request_id, 1, [token])
                mismatches += ok != reference.append(request_id, token)
                if not ok:
                    break
                m.commit(request_id)
        m.check()
        stats = m.snapshot_stats()
    return {
        "requests": args.trace_requests, "max_live": args.trace_live,
        "blocks": args.trace_blocks, "tokens_per_page": tpp,
        "system_prompt_lengths": lengths,
        "manager_hit_rate": stats["prefix_hit_rate"], "reference_hit_rate": reference.hit_rate,
        "manager_hit_tokens": stats["prefix_hit_tokens"], "reference_hit_tokens": reference.hit,
        "queried_tokens": stats["prefix_queried_tokens"],
        "equal": stats["prefix_hit_rate"] == reference.hit_rate and mismatches == 0,
        "decision_mismatches": mismatches, "admissions_refused": refused,
        "evictions": stats["evictions"],
    }


# --- output ------------------------------------------------------------------------------------------


def markdown(r: dict) -> str:
    ops = r["ops"]
    lines = [
        "# KV cache manager: cost per operation (CPU backend)",
        "",
        (f"{r['live_requests']} live requests in {r['slots']} slots, {r['blocks']} blocks of "
         f"{r['tokens_per_page']} tokens ({r['page_bytes'] // 1024} KiB pages, {r['layout']}), "
         f"layer groups: {' + '.join(r['layer_groups'])} in {len(r['pool_blocks'])} pool(s) of "
         f"{' + '.join(map(str, r['pool_blocks']))} blocks, "
         f"max_model_len {r['max_model_len']}; {r['cpu']}, {r['cpus']} CPUs, Linux {r['kernel']}, "
         f"{r['date']}, load average {r['load_average_1min']:.1f} at the start and "
         f"{r['load_average_1min_end']:.1f} at the end (other jobs share this VM), torch threads "
         f"{r['torch_threads']}, peak RSS {r['peak_rss_mib']:.0f} MiB, "
         f"{r['backend_mappings_at_end']} kernel mappings (VMAs) held at the end of a run "
         "(vm.max_map_count is 65,530)."),
        "",
        (f"Each operation timed alone, {r['repeat']} runs on fresh managers; median, p90 and mean "
         "over all samples, and the best run's median (other tenants of this VM add noise)."),
        "",
        "| operation | median µs | p90 µs | mean µs | best run's median µs | samples | target (median) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for op in OPS:
        if op in ops:
            s = ops[op]
            target = TARGETS_US.get(op)
            mark = "" if target is None else (f"≤ {target:g}: " + ("met" if s["median_us"] <= target else "MISSED"))
            lines.append(f"| {op} | {s['median_us']:.2f} | {s['p90_us']:.2f} | {s['mean_us']:.2f} | "
                         f"{s['best_run_median_us']:.2f} | {s['n']} | {mark} |")
    lines += ["", (f"`append_cross` split (medians): {r['append_cross_native_map_median_us']:.2f} µs "
                   "inside the backend's native map call (the mmap system call; mapping_cpu.md has "
                   "this machine's floor for one mmap), "
                   f"{r['append_cross_outside_map_median_us']:.2f} µs outside it (the manager's and "
                   "the backend's Python).")]
    t = r["trace"]
    lines += [
        "",
        "## Prefix hit rate on a shared-prefix trace",
        "",
        (f"{t['requests']} requests, at most {t['max_live']} live, {t['blocks']} blocks of "
         f"{t['tokens_per_page']} tokens; system prompts of {t['system_prompt_lengths']} tokens "
         "(popularity ∝ 1/rank) + 1-63 random tokens, 0-47 decoded tokens, random finish order."),
        "",
        "| | hit rate | hit tokens / queried |",
        "|---|---:|---:|",
        f"| vmemkv manager | {t['manager_hit_rate']:.4f} | {t['manager_hit_tokens']} / {t['queried_tokens']} |",
        f"| block-table reference | {t['reference_hit_rate']:.4f} | {t['reference_hit_tokens']} / {t['queried_tokens']} |",
        "",
        (f"Equal: {'yes' if t['equal'] else 'NO'} ({t['decision_mismatches']} differing admission or "
         f"append decisions; {t['admissions_refused']} admissions refused for memory; "
         f"{t['evictions']} evictions)."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=1000, help="live requests in the background")
    parser.add_argument("--repeat", type=int, default=3, help="runs, each on a fresh manager")
    parser.add_argument("--rounds", type=int, default=2, help="decode rounds over every live request")
    parser.add_argument("--probes", type=int, default=200, help="admit/fork/swap probes per round")
    parser.add_argument("--tokens-per-page", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--trace-requests", type=int, default=4000)
    parser.add_argument("--trace-live", type=int, default=64)
    parser.add_argument("--trace-blocks", type=int, default=320)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="intra-op threads for the copies of fork and swap (torch's default "
                             "when not given)")
    parser.add_argument("--hybrid", action="store_true",
                        help="two layer groups: one full-attention layer, one sliding-window layer")
    parser.add_argument("--window", type=int, default=256, help="the sliding window with --hybrid")
    parser.add_argument("--compare", action="store_true",
                        help="one group against two in one process, stepped alternately "
                             "(manager_group_compare_cpu.md / .json with --out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="write manager_cpu.md and manager_cpu.json here")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    results = {
        "cpu": cpu_model(), "cpus": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "load_average_1min": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(), "seed": args.seed, "hybrid": args.hybrid,
    }
    if args.compare:
        results["compare"] = compare_groups(args)
        results["load_average_1min_end"] = os.getloadavg()[0]
        table = compare_markdown(results, results["compare"])
        if args.out:
            write_results(args.out, "manager_group_compare_cpu", results, table)
        print(json.dumps(results) if args.json else table)
        return results
    results.update(measure_all_ops(args))
    results["trace"] = run_trace(args)
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["load_average_1min_end"] = os.getloadavg()[0]
    results["targets_us"] = TARGETS_US
    results["targets_met"] = {op: results["ops"][op]["median_us"] <= target
                              for op, target in TARGETS_US.items()}

    table = markdown(results)
    if args.out:
        write_results(args.out, "manager_hybrid_cpu" if args.hybrid else "manager_cpu", results, table)
    print(json.dumps(results) if args.json else table)
    return results


if __name__ == "__main__":
    result = main()
    sys.exit(0 if "compare" in result or result["trace"]["equal"] else 1)  # the hit rates must agree
