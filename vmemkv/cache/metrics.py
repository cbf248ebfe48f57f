"""Timing inside the library: an optional collector that the KV cache manager and its
virtual-memory backend report to (as vLLM passes its ``metrics_collector``).

    metrics = KVMetricsCollector()
    manager = KVCacheManager(config, metrics=metrics)   # the manager hands it to its backend
    ...
    metrics.snapshot()   # {"manager_seconds": ..., "inline_map_seconds": ..., "operations": {...}}

What it counts:

* **manager operations** (``operations``): calls and seconds of each public operation (admit,
  allocate, commit, free, fork, reorder, truncate, preempt, swap_in, allocate_lookahead, the
  queries a scheduler asks, ...), outermost calls only: an operation's time includes the ones it
  calls (``preempt`` -> ``free``), so the seconds add up to ``manager_seconds`` without counting
  anything twice. Operations are timed on the thread that drives the manager (one at a time: the
  manager is not thread safe); ``map_lookahead`` is not one of them, see below.
* **backend mapping** (map/unmap calls of the backend, whole calls), split by where it runs:
  ``inline`` on the step thread (inside operations, or while attention makes slots readable),
  ``background`` inside ``map_lookahead``, which the engine runs on its worker thread, overlapped
  with the forward pass.

The manager's operations are decorated with :func:`timed`. Without a collector
(``metrics=None``, the default) that costs one call and one attribute check per operation; with
one, the outermost operation runs inside :meth:`KVMetricsCollector.time_operation`, which sets
``busy``, so nested operations run untimed.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable, Iterator

__all__ = ["KVMetricsCollector", "Timing", "timed"]


def timed(method: Callable) -> Callable:
    """Count a manager method as the operation of its name in the manager's collector (if it
    has one): outermost calls only, so an operation's time includes those it calls."""
    name = method.__name__

    @functools.wraps(method)
    def timed_method(self, *args: Any, **kwargs: Any) -> Any:
        metrics = self.metrics
        if metrics is None or metrics.busy:
            return method(self, *args, **kwargs)
        return metrics.time_operation(name, method, self, *args, **kwargs)

    return timed_method


@dataclass
class Timing:
    """Calls and seconds of one kind of work."""

    calls: int = 0
    seconds: float = 0.0


class KVMetricsCollector:
    """Counters the manager and its backend add to; read them any time (``snapshot``)."""

    def __init__(self) -> None:
        self.operations: dict[str, Timing] = {}  # manager operation -> outermost calls, seconds
        self.inline_mapping = Timing()  # backend map/unmap on the step thread
        self.background_mapping = Timing()  # backend map/unmap inside map_lookahead
        self.busy = False  # inside a timed operation: nested ones run untimed
        self._thread = threading.local()  # .background: inside map_lookahead on this thread

    # --- what the manager and the backends call ---------------------------------------------
    def time_operation(self, name: str, method: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``method(*args, **kwargs)`` as manager operation ``name`` and count it."""
        self.busy = True
        start = perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            elapsed = perf_counter() - start
            self.busy = False
            timing = self.operations.get(name)
            if timing is None:
                timing = self.operations[name] = Timing()
            timing.calls += 1
            timing.seconds += elapsed

    @contextmanager
    def background(self) -> Iterator[None]:
        """Backend mapping on this thread inside the block counts as background mapping."""
        self._thread.background = True
        try:
            yield
        finally:
            self._thread.background = False

    def record_mapping(self, seconds: float) -> None:
        """One backend map or unmap call took ``seconds``."""
        timing = (self.background_mapping if getattr(self._thread, "background", False)
                  else self.inline_mapping)
        timing.calls += 1
        timing.seconds += seconds

    # --- reading ------------------------------------------------------------------------------
    @property
    def manager_seconds(self) -> float:
        """Seconds in manager operations (backend mapping inside them included)."""
        return sum(t.seconds for t in list(self.operations.values()))

    def snapshot(self) -> dict:
        """The counters as plain numbers: totals, and ``operations`` as ``{name: {"calls",
        "seconds"}}`` (safe to call from another thread while the manager runs)."""
        operations = {name: {"calls": t.calls, "seconds": t.seconds}
                      for name, t in list(self.operations.items())}
        return {
            "manager_seconds": sum(op["seconds"] for op in operations.values()),
            "manager_calls": sum(op["calls"] for op in operations.values()),
            "inline_map_seconds": self.inline_mapping.seconds,
            "inline_map_calls": self.inline_mapping.calls,
            "background_map_seconds": self.background_mapping.seconds,
            "background_map_calls": self.background_mapping.calls,
            "operations": operations,
        }
