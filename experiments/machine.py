"""What machine a benchmark ran on, and writing its results files (shared by the benchmarks here)."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(out: Path, stem: str, results, markdown: str) -> None:
    """``out/<stem>.json`` (the results) and ``out/<stem>.md`` (their table), ``out`` made if new."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
