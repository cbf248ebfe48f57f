"""How many long requests of hybrid models fit at once in one KV byte budget: one pool shared by
layer groups whose blocks have the same bytes (the coordinator's default) against the static split
of separate pools (``local_blocks``: each local group sized for every slot at its window's peak,
the full-attention group the rest of the bytes).

For each model shape (layers, KV heads, head dim, local:global pattern and window from the
models' published configs, bf16, CPU pages; ``report_group_pages.MODELS``) the manager alone is
driven as an engine drives it: requests of ``--prompt-len`` tokens are admitted one after another
and prefilled in chunks of ``--chunk`` tokens (commits between chunks, so blocks behind a window
go back), round-robin, then every one decodes ``--new-tokens`` tokens in lockstep. The count is
the most requests that all reach their end with no refusal (bisected: ``k`` fit, ``k + 1`` do not).
Nothing is written, so the pool's memfd pages stay untouched: the figures are the manager's
accounting of ``--budget-gib`` of KV bytes, not resident memory.

Models whose kinds have different layer counts (Gemma-3's 5 local : 1 global) get separate pools
either way (their blocks differ in bytes); equal-sized groups for them (vLLM's split) are not
built yet, so both columns match there.

    python experiments/bench_group_pools.py                  # the table
    python experiments/bench_group_pools.py --json           # one JSON object
    python experiments/bench_group_pools.py --out experiments/results   # group_pools_cpu.md / .json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vmemkv import CacheConfig, KVCacheManager, KVRequest  # noqa: E402
from vmemkv.cache.layer_groups import LayerGroups, group_configs  # noqa: E402

from machine import cpu_model, write_results  # noqa: E402
from report_group_pages import MODELS  # noqa: E402


def layer_windows(layers: int, local_per_global: int, window: int) -> list[int | None]:
    """``local_per_global`` local layers of ``window``, then a global one, repeated."""
    return [None if i % (local_per_global + 1) == local_per_global else window for i in range(layers)]


def config_for(shape, args) -> CacheConfig:
    layers, kv_heads, head_dim, _, _ = shape
    token_bytes = layers * kv_heads * head_dim * 2 * 2  # K and V, bf16
    tokens_per_page = 16
    num_blocks = int(args.budget_gib * (1 << 30)) // (token_bytes * tokens_per_page)
    return CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                       tokens_per_page=tokens_per_page, num_blocks=num_blocks, max_num_seqs=args.slots,
                       max_model_len=args.prompt_len + args.new_tokens, enable_prefix_caching=False)


def all_fit(config: CacheConfig, windows, count: int, args, local_blocks: int | None) -> bool:
    """Whether ``count`` requests all reach ``prompt_len + new_tokens`` tokens at once."""
    with KVCacheManager(config, layer_windows=windows, chunk_tokens=args.chunk,
                        local_blocks=local_blocks) as manager:
        reqs = [KVRequest(f"r{i}", [(7 * i + t) % 50000 for t in range(args.prompt_len)]) for i in range(count)]
        for req in reqs:
            if manager.admit(req, token_budget=args.chunk) is None:
                return False
            manager.commit(req)
        while any(req.num_tokens < args.prompt_len for req in reqs):  # chunked prefill, round-robin
            for req in reqs:
                step = min(args.chunk, args.prompt_len - req.num_tokens)
                if step:
                    if not manager.allocate(req, step):
                        return False
                    manager.commit(req)
        for _ in range(args.new_tokens):  # decode in lockstep
            for req in reqs:
                req.token_ids.append(1)
                if not manager.allocate(req, 1):
                    return False
            manager.commit_all(reqs)
        manager.check()
        return True


def most_that_fit(config: CacheConfig, windows, args, local_blocks: int | None) -> int:
    """The largest count that ``all_fit`` (fitting is monotone in the count: bisect)."""
    low, high = 0, args.slots  # low fits; high + 1 does not (no more slots)
    while low < high:
        middle = (low + high + 1) // 2
        if all_fit(config, windows, middle, args, local_blocks):
            low = middle
        else:
            high = middle - 1
    return low


def measure(args) -> list[dict]:
    rows = []
    for name, shape in MODELS.items():
        layers, kv_heads, head_dim, local_per_global, window = shape
        windows = layer_windows(layers, local_per_global, window)
        config = config_for(shape, args)
        groups = LayerGroups.from_windows(windows)
        static = group_configs(config, groups, args.chunk)  # the split separate pools get
        static_local = static[1].num_blocks
        with KVCacheManager(config, layer_windows=windows, chunk_tokens=args.chunk) as probe:
            pools = len(probe.memories)
        rows.append({
            "model": name, "layers": layers, "local_per_global": local_per_global, "window": window,
            "kv_bytes": config.num_blocks * config.make_layout().block_bytes,
            "groups": [f"{spec.describe()} x{len(group)}" for spec, group in zip(groups.specs, groups.layers)],
            "pools_shared": pools, "static_local_blocks": static_local,
            "static_global_blocks": static[0].num_blocks,
            "fit_shared": most_that_fit(config, windows, args, None),
            "fit_static": most_that_fit(config, windows, args, static_local),
        })
    return rows


def markdown(results: dict) -> str:
    args = results["args"]
    lines = [
        "# Requests that fit one KV budget: one shared pool against the static split",
        "",
        (f"`python experiments/bench_group_pools.py` — {args['budget_gib']} GiB of bf16 KV per model, "
         f"{args['slots']} slots, requests of {args['prompt_len']} prompt tokens (prefill chunks of "
         f"{args['chunk']}) + {args['new_tokens']} decoded, run at once to the end; prefix caching off. "
         f"The manager alone on {results['cpu']} ({results['date']}); nothing is written, so the "
         "figures are the manager's accounting, not resident memory."),
        "",
        "| model | local : global, window | pools (shared) | static split: local / global blocks | "
        "fit, shared pool | fit, static split |",
        "|---|---|---:|---|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['model']} | {row['local_per_global']} : 1, {row['window']} | {row['pools_shared']} | "
                     f"{row['static_local_blocks']} / {row['static_global_blocks']} | {row['fit_shared']} | "
                     f"{row['fit_static']} |")
    lines += ["", ("Gemma-3's local and global groups have different layer counts, so their blocks differ "
                   "in bytes and they keep two pools either way (equal-sized groups, vLLM's split, would "
                   "let them share: `report_group_pages.py` gives their page geometry).")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "args": {k: v for k, v in vars(args).items() if k not in ("json", "out")}}
    results["rows"] = measure(args)
    table = markdown(results)
    if args.out:
        write_results(args.out, "group_pools_cpu", results, table)
    print(json.dumps(results) if args.json else table)
    return results


if __name__ == "__main__":
    main()
