"""What machine a benchmark ran on, and writing its results files (shared by the benchmarks here)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Callable


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


def report_main(stem: str, description: str, report: Callable[[], dict], markdown: Callable[[dict], str],
                argv=None) -> int:
    """The command line of a report computed without timing (``report_*.py``): prints the table
    (or, with ``--json``, the results), and with ``--out DIR`` writes ``DIR/<stem>.md`` and ``.json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help=f"write {stem}.md and {stem}.json here")
    args = parser.parse_args(argv)
    result = report()
    if args.out:
        write_results(args.out, stem, result, markdown(result))
    print(json.dumps(result) if args.json else markdown(result), end="\n" if args.json else "")
    return 0
