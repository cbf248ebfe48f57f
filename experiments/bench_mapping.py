"""How long mapping, unmapping and remapping a page takes, in µs per page.

For each batch size (pages per ``backend.map`` call) the whole reservation is mapped, remapped to
other pages, and unmapped, batch by batch. The main numbers use *scattered* physical pages (a
random permutation: one system call per page, the worst case); *runs* map consecutive pages to
consecutive pages, which the CPU backend coalesces into one call per batch. On the CPU backend the
same run also measures the floors: ``map_each`` (a C loop, one plain mmap per page, no
bookkeeping) and one Python ``ctypes`` mmap per page, and what a decode step's lookahead block
costs mapped over the bare reservation, over the batched-read filler, and over filler a read has
touched (``measure_lookahead_once``). On CUDA it also measures giving free pages back and taking
them again, per page (``measure_give_back_once``; the CPU's: ``bench_give_back.py``).

    python experiments/bench_mapping.py                 # readable table
    python experiments/bench_mapping.py --json          # one JSON object
    python experiments/bench_mapping.py --out experiments/results   # mapping_cpu.md / .json
    python experiments/bench_mapping.py --json --cuda-only         # the GPU check's step

Exit status: 0 when everything asked for was measured; 1 when the CUDA backend failed (an error is
a failure, never a skip: its JSON says ``cuda_error``); 3 (``EXIT_SKIPPED``) with ``--cuda-only`` on a
machine without CUDA (JSON ``{"skipped": ...}``; without ``--cuda-only`` that machine just gets the
CPU numbers and ``cuda_skipped``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vmemkv.memory.vmm import CpuBackend, VirtualMemoryBackend
from vmemkv.memory.vmm.cpu import load_native
from machine import cpu_model, write_results  # experiments/machine.py, beside this script

EXIT_SKIPPED = 3  # nothing to measure here (no CUDA with --cuda-only); gpu_check.sh: "skipped"
BATCH_SIZES = (1, 16, 64, 256)
PHASES = ("map", "remap", "unmap", "runs_map", "runs_unmap")


def batches(array: np.ndarray, size: int) -> list[np.ndarray]:
    """Slices made before timing, so slicing is not measured."""
    return [np.ascontiguousarray(array[i:i + size]) for i in range(0, len(array), size)]


def timed_us_per_page(fn, args_list: list[tuple], num_pages: int) -> float:
    start = time.perf_counter()
    for args in args_list:
        fn(*args)
    return (time.perf_counter() - start) * 1e6 / num_pages


def measure_backend_once(backend: VirtualMemoryBackend, vrange, batch: int, rng: np.random.Generator) -> dict:
    """One pass of every phase at one batch size; returns µs per page and calls per page."""
    n = vrange.num_pages
    virt = batches(np.arange(n, dtype=np.int64), batch)
    scattered = batches(rng.permutation(n).astype(np.int64), batch)
    other = batches(rng.permutation(n).astype(np.int64), batch)
    runs = virt  # virtual page i -> physical page i: consecutive on both sides

    out: dict[str, float] = {}
    for phase, fn, args in (
        ("map", backend.map, [(vrange, v, p) for v, p in zip(virt, scattered)]),
        ("remap", backend.map, [(vrange, v, p) for v, p in zip(virt, other)]),
        ("unmap", backend.unmap, [(vrange, v) for v in virt]),
        ("runs_map", backend.map, [(vrange, v, p) for v, p in zip(virt, runs)]),
        ("runs_unmap", backend.unmap, [(vrange, v) for v in virt]),
    ):
        calls_before = backend.stats.map_calls + backend.stats.unmap_calls
        backend.synchronize()
        out[f"{phase}_us_per_page"] = timed_us_per_page(fn, args, n)
        calls = backend.stats.map_calls + backend.stats.unmap_calls - calls_before
        out[f"{phase}_calls_per_page"] = calls / n
    return out


def measure_floors_once(backend: CpuBackend, vrange, rng: np.random.Generator, ctypes_pages: int) -> dict:
    """The C loop of plain mmaps, and one ctypes mmap per page, over scattered pages."""
    n = vrange.num_pages
    virt = np.arange(n, dtype=np.int64)
    phys = rng.permutation(n).astype(np.int64)
    fd, base, ps = backend._fd, vrange.address, backend.page_size
    _native = load_native()
    out = {
        "syscall_floor_us_per_page": timed_us_per_page(_native.map_each,
                                                       [(fd, base, ps, n, n, virt, phys)], n),
        "syscall_floor_unmap_us_per_page": timed_us_per_page(_native.unmap_each, [(base, ps, n, virt)], n),
    }
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10  # MAP_FIXED
    unmap_flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10 | 0x4000  # MAP_FIXED | MAP_NORESERVE
    pages = [(int(v), int(p)) for v, p in zip(virt[:ctypes_pages], phys[:ctypes_pages])]
    start = time.perf_counter()
    for v, p in pages:
        libc.mmap(base + v * ps, ps, prot, flags, fd, p * ps)
    out["ctypes_us_per_page"] = (time.perf_counter() - start) * 1e6 / len(pages)
    start = time.perf_counter()
    for v, _ in pages:
        libc.mmap(base + v * ps, ps, 0, unmap_flags, -1, 0)
    out["ctypes_unmap_us_per_page"] = (time.perf_counter() - start) * 1e6 / len(pages)
    return out


def measure_overhead_once(backend: VirtualMemoryBackend, vrange, calls: int = 2000) -> dict:
    """µs per ``map`` call that needs no system call (the page is already there): the cost of the
    Python and C bookkeeping alone."""
    virt, phys = np.array([0], np.int64), np.array([0], np.int64)
    backend.map(vrange, virt, phys)
    start = time.perf_counter()
    for _ in range(calls):
        backend.map(vrange, virt, phys)
    elapsed = time.perf_counter() - start
    backend.unmap(vrange, virt)
    return {"noop_map_us_per_call": elapsed * 1e6 / calls}


FILLER_CASES = ("reservation", "filler", "read_filler")


def measure_lookahead_once(backend: CpuBackend, slots: int = 64, own: int = 4, filler: int = 12) -> dict:
    """µs per page of what a decode step's lookahead does on CPU: map one block at each slot's
    next logical page, over (``reservation``) the bare reservation, (``filler``) the batched-read
    filler as ``SlotMapper.make_readable`` lays it out (offset ``i`` of every slot maps the same
    filler page ``i``, one coalesced mapping per slot) never read, or (``read_filler``) that filler
    after a batched read touched every byte of it. The pool's last ``filler`` pages are the filler,
    its first ``slots * (own + 1)`` the requests' blocks."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the read on one thread, as the engine's CPU forward: a read on
    try:                      # two threads makes each remap flush the other CPU's TLB too (2x)
        for case in FILLER_CASES:
            _lookahead_case(backend, case, slots, own, filler, out)
    finally:
        torch.set_num_threads(threads)
    return out


def _lookahead_case(backend: CpuBackend, case: str, slots: int, own: int, filler: int, out: dict) -> None:
    """One of ``FILLER_CASES`` (see ``measure_lookahead_once``) into ``out``."""
    slot_pages = own + filler
    vrange = backend.reserve(slots * slot_pages)
    try:
        view = backend.tensor(vrange, torch.uint8, (slots * slot_pages * backend.page_size,), (1,))
        for slot in range(slots):
            base = slot * slot_pages
            backend.map(vrange, np.arange(base, base + own, dtype=np.int64),
                        np.arange(slot * own, (slot + 1) * own, dtype=np.int64))
            if case != "reservation":  # offset i of every slot maps filler page i, as make_readable
                offsets = np.arange(own, slot_pages, dtype=np.int64)
                backend.map(vrange, base + offsets, backend.num_pages - filler + offsets - own)
            if case == "read_filler":
                view[(base + own) * backend.page_size:(base + slot_pages) * backend.page_size].sum()
        blocks = slots * own + np.arange(slots, dtype=np.int64)
        jobs = [(np.array([slot * slot_pages + own], np.int64), blocks[slot: slot + 1])
                for slot in range(slots)]
        out[f"lookahead_over_{case}_us_per_page"] = timed_us_per_page(
            lambda v, p: backend.map(vrange, v, p), jobs, slots)
    finally:
        backend.release(vrange)


def measure_give_back_once(backend: VirtualMemoryBackend, pages: int) -> dict:
    """µs per page to give ``pages`` free pages back (CUDA: out of the pool window, then
    ``cuMemRelease``) and to take them again (``cuMemCreate``, mapped in the window again)."""
    backend.pool_window()  # made once: a give-back unmaps a page from it, a take maps it back
    chosen = list(range(pages))
    start = time.perf_counter()
    backend.discard_pages(chosen)
    give = time.perf_counter() - start
    start = time.perf_counter()
    backend.take_pages(chosen)
    take = time.perf_counter() - start
    return {"give_back_us_per_page": give / pages * 1e6, "take_again_us_per_page": take / pages * 1e6}


def median_of(samples: list[dict]) -> dict:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def bench_backend(backend: VirtualMemoryBackend, num_pages: int, reps: int, seed: int,
                  floors: bool, ctypes_pages: int) -> dict:
    rng = np.random.default_rng(seed)
    vrange = backend.reserve(num_pages)
    results: dict[str, float] = {}
    try:
        per_batch = {b: [] for b in BATCH_SIZES}
        floor_samples = []
        for _ in range(reps):  # interleaved, so drift on a shared VM hits every number alike
            for b in BATCH_SIZES:
                per_batch[b].append(measure_backend_once(backend, vrange, b, rng))
            if floors:  # the CPU backend alone
                floor_samples.append(measure_floors_once(backend, vrange, rng, ctypes_pages)
                                     | measure_overhead_once(backend, vrange)
                                     | measure_lookahead_once(backend))
        for b, samples in per_batch.items():
            for key, value in median_of(samples).items():
                results[f"{key}_batch{b}"] = value
        if floors:
            results.update(median_of(floor_samples))
    finally:
        backend.release(vrange)
    return results


def run_cpu(args) -> dict:
    with CpuBackend(args.page_size, args.num_pages) as backend:
        results = bench_backend(backend, args.num_pages, args.reps, args.seed, True, args.ctypes_pages)
    floor = results["syscall_floor_us_per_page"]
    results["map_batch64_over_floor"] = results["map_us_per_page_batch64"] / floor
    results["runs_map_batch64_over_floor"] = results["runs_map_us_per_page_batch64"] / floor
    results["target_met"] = bool(results["map_batch64_over_floor"] <= 1.25
                                 and results["runs_map_batch64_over_floor"] < 1.0)
    return results


def no_cuda_reason(args) -> str | None:
    """Why the CUDA backend is not measured here (None: it is). Only the absence of a GPU is a
    reason; a GPU whose backend fails is an error (``run_cuda``)."""
    if args.no_cuda:
        return "--no-cuda given"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU here (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}: torch.cuda.is_available() is False)")
    return None


def run_cuda(args) -> dict:
    """The same phases on the CUDA backend (call only where ``no_cuda_reason`` is None). Any
    failure, import of cuda-bindings included, comes back as ``cuda_error``: a GPU is here, so a
    backend that cannot run is broken."""
    try:
        from vmemkv.memory.vmm.cuda import CudaBackend

        with CudaBackend(args.cuda_page_size, args.cuda_num_pages) as backend:
            results = bench_backend(backend, args.cuda_num_pages, args.reps, args.seed, False, 0)
            results.update(median_of([measure_give_back_once(backend, min(64, args.cuda_num_pages))
                                      for _ in range(args.reps)]))
    except Exception as e:  # noqa: BLE001 -- reported in the JSON and the exit status
        print(f"bench_mapping: CUDA backend FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return {"cuda_error": f"{type(e).__name__}: {e}"}
    return {f"cuda_{k}": v for k, v in results.items()}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark, prints the table or JSON; returns the exit status (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=64 * 1024)
    parser.add_argument("--num-pages", type=int, default=4096, help="pool and reservation size in pages")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ctypes-pages", type=int, default=1024, help="pages timed through ctypes")
    parser.add_argument("--cuda-page-size", type=int, default=2 * 1024 * 1024)
    parser.add_argument("--cuda-num-pages", type=int, default=1024)
    parser.add_argument("--no-cuda", action="store_true")
    parser.add_argument("--cuda-only", action="store_true",
                        help=f"measure only the CUDA backend; exit {EXIT_SKIPPED} (skipped) without CUDA")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="write mapping_cpu.md and mapping_cpu.json here")
    args = parser.parse_args(argv)
    if args.cuda_only and args.no_cuda:
        parser.error("--cuda-only and --no-cuda exclude each other")

    skipped = no_cuda_reason(args)
    if args.cuda_only and skipped:
        print(f"bench_mapping: skipped: {skipped}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": skipped}))
        return EXIT_SKIPPED
    results = {
        "page_size": args.page_size, "num_pages": args.num_pages, "reps": args.reps,
        "batch_sizes": list(BATCH_SIZES), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "kernel": platform.release(), "date": datetime.date.today().isoformat(),
        "load_average_1min": os.getloadavg()[0],  # other work on the machine slows every mmap
    }
    if not args.cuda_only:
        results.update(run_cpu(args))
    if skipped:
        results["cuda_skipped"] = skipped
    else:
        results.update(run_cuda(args), cuda_page_size=args.cuda_page_size,
                       cuda_num_pages=args.cuda_num_pages)
    # The tables need the CPU numbers; with --cuda-only the JSON is the whole report.
    table = None if args.cuda_only else markdown(results)
    if args.out and table is not None:
        write_results(args.out, "mapping_cpu", results, table)
    print(json.dumps(results) if args.json or table is None else table)
    return 1 if "cuda_error" in results else 0


def markdown(r: dict) -> str:
    lines = [
        "# Mapping cost (µs per page)",
        "",
        (f"CPU backend: pool and reservation of {r['num_pages']} × {r['page_size'] // 1024} KiB pages, "
         f"median of {r['reps']} repetitions; {r['cpu']}, {r['cpus']} CPUs, Linux {r['kernel']}, "
         f"{r['date']}, load average {r['load_average_1min']:.1f}. Scattered = a random permutation of physical pages (one mmap per page); "
         "runs = consecutive pages (one mmap per batch)."),
        "",
    ]
    lines += backend_table(r, "")
    lines += [
        "",
        "| floor (scattered, one page per call) | map | unmap |",
        "|---|---:|---:|",
        (f"| C loop of plain mmap (`map_each`) | {r['syscall_floor_us_per_page']:.2f} | "
         f"{r['syscall_floor_unmap_us_per_page']:.2f} |"),
        f"| Python ctypes mmap | {r['ctypes_us_per_page']:.2f} | {r['ctypes_unmap_us_per_page']:.2f} |",
        "",
        (f"A `map` call that needs no system call costs {r['noop_map_us_per_call']:.2f} µs "
         "(Python + C bookkeeping)."),
        "",
        ("A lookahead block (one page per slot, 64 slots) mapped over: the bare reservation "
         f"{r['lookahead_over_reservation_us_per_page']:.2f} µs, the batched-read filler never read "
         f"{r['lookahead_over_filler_us_per_page']:.2f} µs, filler a batched read touched "
         f"{r['lookahead_over_read_filler_us_per_page']:.2f} µs per page (the kernel drops the "
         "touched page's entries)."),
        "",
        (f"Batch 64, scattered: {r['map_batch64_over_floor']:.2f} × the C floor; runs: "
         f"{r['runs_map_batch64_over_floor']:.3f} × the floor (target ≤ 1.25 and < 1: "
         f"{'met' if r['target_met'] else 'MISSED'})."),
    ]
    if "cuda_error" in r:
        lines += ["", f"CUDA backend: not measured ({r['cuda_error']})."]
    if "cuda_map_us_per_page_batch64" in r:
        pages = f"{r['cuda_num_pages']} × {r['cuda_page_size'] // 2**20} MiB pages"
        lines += ["", f"## CUDA backend ({pages})", ""]
        lines += backend_table(r, "cuda_")
    return "\n".join(lines) + "\n"


def backend_table(r: dict, prefix: str) -> list[str]:
    lines = ["| batch | map | remap | unmap | map, runs | unmap, runs | calls/page (map, runs) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for b in r["batch_sizes"]:
        us = {phase: r[f"{prefix}{phase}_us_per_page_batch{b}"] for phase in PHASES}
        lines.append(f"| {b} | {us['map']:.2f} | {us['remap']:.2f} | {us['unmap']:.2f} | "
                     f"{us['runs_map']:.3f} | {us['runs_unmap']:.3f} | "
                     f"{r[f'{prefix}runs_map_calls_per_page_batch{b}']:.3f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
