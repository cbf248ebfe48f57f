"""What giving KV memory back costs on CPU, per page: punching free pages out of the memfd
(``CpuBackend.discard_pages``, one ``fallocate(PUNCH_HOLE)`` per run of consecutive pages), and
taking one again (the first write after a give-back faults a zeroed page in) against a write to a
page that kept its memory; and what ``KVCacheManager.release_free_memory`` costs a block.

    python experiments/bench_give_back.py --out experiments/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, write_results  # noqa: E402

from vmemkv import CacheConfig, KVCacheManager  # noqa: E402
from vmemkv.memory.vmm import CpuBackend  # noqa: E402


def per_page_us(page_size: int, pages: int, scattered: bool, repeats: int) -> dict:
    """µs per page: give back ``pages`` pages (every other page when scattered: one call each),
    write them again (taking pages again), and write them once more (memory kept)."""
    backend = CpuBackend(page_size, 2 * pages)
    window = backend.pool_window()
    chosen = list(range(0, 2 * pages, 2)) if scattered else list(range(pages))
    index = torch.tensor(chosen)
    give, take, kept = [], [], []
    try:
        for _ in range(repeats):
            window[index] = 1  # resident
            start = time.perf_counter()
            backend.discard_pages(chosen)
            give.append(time.perf_counter() - start)
            start = time.perf_counter()
            for page in chosen:  # a row write each, as a forward writes its tokens' K/V
                window[page].fill_(2)
            take.append(time.perf_counter() - start)
            start = time.perf_counter()
            for page in chosen:
                window[page].fill_(3)
            kept.append(time.perf_counter() - start)
    finally:
        backend.close()
    us = lambda samples: statistics.median(samples) / pages * 1e6  # noqa: E731
    return {"page_bytes": page_size, "pages": pages, "scattered": scattered,
            "give_back_us_per_page": us(give), "write_taking_again_us_per_page": us(take),
            "write_kept_us_per_page": us(kept)}


def manager_us_per_block(num_blocks: int, repeats: int) -> dict:
    """µs per block of ``release_free_memory`` after every block was written and freed."""
    config = CacheConfig(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32,
                         num_blocks=num_blocks, max_num_seqs=8, max_model_len=num_blocks * 16 // 8,
                         enable_prefix_caching=False)
    samples = []
    with KVCacheManager(config) as manager:
        window = manager.memories[0].block_window()
        per_request = num_blocks // 8
        for _ in range(repeats):
            for i in range(8):
                manager.admit(f"r{i}", list(range(per_request * manager.tokens_per_page)))
            window[:] = 1
            for i in range(8):
                manager.free(f"r{i}")
            start = time.perf_counter()
            given = manager.release_free_memory()
            samples.append(time.perf_counter() - start)
            assert given == num_blocks * manager.block_bytes
        block_bytes = manager.block_bytes
        del window  # a view of the pool: close refuses while one is held
    return {"blocks": num_blocks, "block_bytes": block_bytes,
            "release_free_memory_us_per_block": statistics.median(samples) / num_blocks * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write give_back_cpu.md and .json here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = [per_page_us(size, pages, scattered, args.repeats)
            for size, pages in ((16 * 1024, 1024), (2 * 1024 * 1024, 64)) for scattered in (False, True)]
    manager = manager_us_per_block(2048, args.repeats)
    results = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_1min": load,
               "date": time.strftime("%Y-%m-%d"), "torch_threads": 1, "pages": rows, "manager": manager}
    lines = ["# Giving KV memory back: cost per page (CPU backend)", "",
             f"`python experiments/bench_give_back.py --out experiments/results` ({results['date']}, "
             f"{results['cpu']}, {results['cpus']} CPUs, load average {load:.1f}, one torch thread; "
             f"medians of {args.repeats} repeats). A give-back is one `fallocate(PUNCH_HOLE)` per run "
             "of consecutive pages; the first write after it faults zeroed pages in.", "",
             "| page | pages | layout | give back µs/page | write, taking the page again µs/page | "
             "write, page kept µs/page |", "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['page_bytes'] // 1024} KiB | {row['pages']} | "
                     f"{'every other page' if row['scattered'] else 'consecutive'} | "
                     f"{row['give_back_us_per_page']:.2f} | {row['write_taking_again_us_per_page']:.2f} | "
                     f"{row['write_kept_us_per_page']:.2f} |")
    lines += ["", f"`KVCacheManager.release_free_memory()` of {manager['blocks']} free blocks of "
              f"{manager['block_bytes'] // 1024} KiB (SmolLM2-135M's KV in fp32, 16 tokens a block): "
              f"{manager['release_free_memory_us_per_block']:.2f} µs a block.", ""]
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_results(args.out, "give_back_cpu", results, markdown)


if __name__ == "__main__":
    main()
