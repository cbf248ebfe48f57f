"""``experiments/bench_vs_vllm_online.py``'s tables over turns: each cell the median of its runs, each
ratio the median of the turns' ratios (vmemkv's turn against vLLM's same turn), its range beside."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # report() imports machine.py beside it
    spec = importlib.util.spec_from_file_location("bench_vs_vllm_online", ROOT / "experiments" / "bench_vs_vllm_online.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bench, system: str, repeat: int, throughput: float, ttft_p99: float, dataset: str = "random") -> dict:
    metrics = dict.fromkeys(bench.METRICS, 1.0)
    metrics.update(request_throughput=throughput, p99_ttft_ms=ttft_p99, completed=48)
    return {"threads": 1, "dataset": dataset, "rate": "inf", "system": system, "repeat": repeat, **metrics}


def test_cells_are_medians_and_ratios_pair_each_turn(bench):
    rows = [run(bench, "vmemkv", 0, 2.0, 4000), run(bench, "vllm", 0, 1.0, 4100),
            run(bench, "vmemkv", 1, 3.0, 4300), run(bench, "vllm", 1, 2.0, 4200),
            run(bench, "vmemkv", 2, 2.2, 4100), run(bench, "vllm", 2, 2.0, 4000),
            run(bench, "vmemkv", 0, 5.0, 900, "prefix_repetition"), run(bench, "vllm", 0, 4.0, 1000, "prefix_repetition")]
    results, markdown = bench.report(rows, 0.5, 48, 3, "cmd")
    cells = {(r["dataset"], r["system"]): r for r in results["medians"]}
    assert cells["random", "vmemkv"]["request_throughput"] == 2.2 and cells["random", "vmemkv"]["runs"] == 3
    assert cells["random", "vllm"]["p99_ttft_ms"] == 4100
    assert [(r["dataset"], r["system"]) for r in results["medians"]] == [
        ("random", "vmemkv"), ("prefix_repetition", "vmemkv"), ("random", "vllm"), ("prefix_repetition", "vllm")]
    # turns 2.0/1.0, 3.0/2.0, 2.2/2.0: median 1.5, not 2.2/2.0 (the medians' ratio)
    assert results["ratios"]["float32-1-random-inf"] == pytest.approx([2.0, 1.5, 1.1])
    assert "float32, 1 thread(s), random, rate inf: 1.50x (1.10-2.00)" in markdown
    assert "prefix_repetition, rate inf: 1.25x;" in markdown or "prefix_repetition, rate inf: 1.25x." in markdown
    assert "| float32 | 1 | random | inf | vmemkv | 2.20 |" in markdown


def test_each_dtype_is_its_own_cell_with_its_peak_memory(bench):
    rows = [{**run(bench, system, 0, throughput, 900), "dtype": dtype, "peak_memory_bytes": mib << 20}
            for system, throughput, dtype, mib in (("vmemkv", 2.0, "float32", 700), ("vllm", 1.0, "float32", 2100),
                                                   ("vmemkv", 3.0, "bfloat16", 450), ("vllm", 4.0, "bfloat16", 1600))]
    results, markdown = bench.report(rows, 0.5, 48, 1, "cmd")
    assert results["ratios"] == {"float32-1-random-inf": [2.0], "bfloat16-1-random-inf": [0.75]}
    assert [(r["dtype"], r["system"]) for r in results["medians"]] == [
        ("bfloat16", "vmemkv"), ("bfloat16", "vllm"), ("float32", "vmemkv"), ("float32", "vllm")]
    assert "| bfloat16 | 1 | random | inf | vllm | 4.00 |" in markdown and "| 1,600 |" in markdown


def test_the_peak_memory_of_a_process_tree_counts_its_children(monkeypatch):
    """``machine.run_with_peak_memory``: a child's grandchild touching 200 MiB shows in the peak."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    from machine import run_with_peak_memory

    grandchild = "import time; b = bytearray(200 << 20); time.sleep(1.5)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}], check=True)"
    peak = run_with_peak_memory([sys.executable, "-c", child], interval=0.1)
    assert 200 << 20 < peak < 1 << 30
