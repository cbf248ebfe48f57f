"""What an engine measures at its start, kept per machine so that the next start reads it.

A measurement (the packed kernels' times, ``kernel_choice.py``) depends on the machine, the
software and what was measured, never on the run: it is stored in one JSON file in vmemkv's cache
(``$VMEMKV_CACHE/measured.json``, or ``$VMEMKV_MEASURED_FILE``) under a key that names all of those, and read back by any later
start whose key is equal. Another CPU, thread count, torch or native build, or model shape is
another key, so it is measured afresh. A measurement taken while other processes held the CPU is
used for that start but not kept (a timing of a contended run can be many times off and would
decide every later start). Delete the file to measure everything again. A damaged or unwritable
file is not an error: the value is measured as if the file were not there.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from vmemkv.engine.models.hub import cache_dir

FILE_NAME = "measured.json"
# The share of its threads' time a measurement must have had to be kept. Timing the packed
# kernels at two threads on two cores beside another busy process got 0.64 of it and times within
# 3 % of a quiet run's; under heavier load times were 2-15x off.
QUIET_SHARE = 0.5


def cache_file() -> Path:
    if os.environ.get("VMEMKV_MEASURED_FILE"):
        return Path(os.environ["VMEMKV_MEASURED_FILE"]).expanduser()
    return cache_dir() / FILE_NAME


def machine() -> dict[str, Any]:
    """What identifies this machine's CPU for a timing: its model, its features, its cores."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "cpu family", "model") and name not in fields:
                    fields[name] = value.strip()
    except OSError:
        pass
    flags = fields.pop("flags", "")
    return {**fields, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "cpus": os.cpu_count()}


def _key(kind: str, key: dict[str, Any]) -> str:
    return kind + ":" + json.dumps({"machine": machine(), **key}, sort_keys=True)


def _read(path: Path) -> dict[str, Any]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    """Replaces the file whole (a rename), so that a reader never sees half of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".measured-", delete=False) as out:
            json.dump(entries, out, indent=1, sort_keys=True)
        os.replace(out.name, path)
    except OSError:
        pass  # not kept: the next start measures again


def remembered(kind: str, key: dict[str, Any], measure: Callable[[], Any],
               threads: int = 1) -> tuple[Any, str | None]:
    """(value, when it was measured) for a value stored under ``kind`` and ``key`` on this
    machine, or (``measure()``, None), stored for next time if the measurement ran on a quiet
    CPU: it got at least ``QUIET_SHARE`` of ``threads`` cores' time. The value must be JSON."""
    path = cache_file()
    full_key = _key(kind, key)
    entry = _read(path).get(full_key)
    if isinstance(entry, dict) and "value" in entry and "measured" in entry:
        return entry["value"], entry["measured"]
    wall, cpu = time.perf_counter(), time.process_time()
    value = measure()
    share = (time.process_time() - cpu) / max((time.perf_counter() - wall) * threads, 1e-9)
    if share < QUIET_SHARE:
        return value, None
    entries = _read(path)  # again: another engine may have written meanwhile
    entries[full_key] = {"value": value, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(path, entries)
    return value, None
