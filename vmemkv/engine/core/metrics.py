"""Serving metrics: Prometheus counters, gauges and histograms, plus raw samples for summaries.

Each ``EngineMetrics`` has its own ``CollectorRegistry``, so several engines (or tests) in one
process never clash over metric names. The engine calls the ``on_*`` hooks from its step thread;
``render()`` and ``summary()`` may be called from any thread (prometheus_client is thread safe,
and the sample lists are only appended to).

Times are seconds from one monotonic clock: pass ``time.monotonic()`` values, or leave ``now``
out and the hook reads that clock itself.

Given the engine's ``KVMetricsCollector`` (``kv_metrics``), ``render()`` also exposes what the KV
cache manager timed, read at scrape time: ``vmemkv_kv_manager_seconds_total`` and
``vmemkv_kv_manager_calls_total`` by ``operation``, and ``vmemkv_kv_mapping_seconds_total`` /
``vmemkv_kv_mapping_calls_total`` by ``where`` (``inline``: on the step thread; ``background``:
the lookahead worker, overlapped with the forward pass).

Given the manager's ``cache_stats`` (a callable returning ``CacheStats``), it also exposes the
prefix cache's hit rate (``vmemkv_prefix_cache_hit_rate``, a gauge: nothing copied per step) and
token counts, read at scrape time: ``vmemkv_prefix_cache_queried_tokens_total``
and ``vmemkv_prefix_cache_hit_tokens_total{tier}`` (prompts at first admission; ``tier`` is
``device``, ``host``, the host tier's blocks copied back, or ``cold``, the cold tier's
decompressed), ``vmemkv_prefix_cache_reprefill_queried_tokens_total`` and
``vmemkv_prefix_cache_reprefill_hit_tokens_total`` (re-admissions after a recompute preemption,
kept out of the hit rate), ``vmemkv_prefix_cache_partial_page_tokens_total`` (prompt tokens
a cached page shared past the page hits, lost because the shared part is shorter than a page),
and the host tier's ``vmemkv_host_cache_demotions_total``, ``..._promotions_total``,
``..._evictions_total`` (blocks) and ``vmemkv_host_cache_copied_bytes_total{direction}``
(``to_host``, ``to_device``), and the cold tier's ``vmemkv_cold_cache_demotions_total``,
``..._promotions_total``, ``..._evictions_total`` and ``vmemkv_cold_cache_stored_bytes_total``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
                               CollectorRegistry,
                               Counter,
                               Gauge,
                               Histogram,
                               disable_created_metrics,
                               generate_latest,
                               )
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vmemkv.cache.config import CacheStats
from vmemkv.errors import VmemkvError
from vmemkv.cache.metrics import KVMetricsCollector

disable_created_metrics()  # no *_created series (process-wide): a scrape shows the values alone

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                          0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_THROUGHPUT_WINDOW_S = 10.0  # the throughput gauge averages over this trailing window


@dataclass
class _RequestTimes:
    added: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class EngineMetrics:
    """Counters and latency samples of one engine."""

    def __init__(self, max_samples: int = 100_000,
                 kv_metrics: KVMetricsCollector | None = None,
                 cache_stats: Callable[[], CacheStats] | None = None,
                 memory_stats: Callable[[], dict] | None = None,
                 kv_bytes_per_token_per_layer: int | None = None) -> None:
        """``memory_stats``: the KV memory's counts when scraped (``snapshot_stats``);
        ``kv_bytes_per_token_per_layer``: what one token caches per layer (K and V, or an MLA
        model's latent row), exported as a gauge."""
        self.registry = CollectorRegistry()
        self._define_metrics()
        if kv_bytes_per_token_per_layer is not None:
            Gauge("vmemkv_kv_bytes_per_token_per_layer", "KV cache bytes one token holds per layer "
                  "(K and V, or an MLA model's latent row)",
                  registry=self.registry).set(kv_bytes_per_token_per_layer)
        if kv_metrics is not None:
            self.registry.register(_KVTimeExporter(kv_metrics))
        if cache_stats is not None:
            self.registry.register(_PrefixCacheExporter(cache_stats))
        if memory_stats is not None:
            self.registry.register(_KVMemoryExporter(memory_stats))
        self._requests: dict[str, _RequestTimes] = {}
        # Raw samples for summary(); bounded so a long-lived server does not grow without limit.
        self.ttft_s: deque[float] = deque(maxlen=max_samples)
        self.tpot_s: deque[float] = deque(maxlen=max_samples)
        self.e2e_s: deque[float] = deque(maxlen=max_samples)
        self._recent_tokens: deque[tuple[float, int]] = deque()  # (time, count) for the gauge
        self._recent_token_count = 0
        self._first_added: float | None = None
        self._last_token: float | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: dict[str, int] = {}
        self._preemptions_seen = 0

    def _define_metrics(self) -> None:
        r = self.registry
        self.requests_finished = Counter("vmemkv_requests_finished", "Requests finished, by reason",
                                         ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vmemkv_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("vmemkv_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("vmemkv_preemptions", "Requests preempted", registry=r)
        self.ttft = Histogram("vmemkv_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vmemkv_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("vmemkv_e2e_request_latency_seconds",
                                     "Time from arrival to finish", buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.running = Gauge("vmemkv_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("vmemkv_num_requests_waiting", "Requests waiting", registry=r)
        self.swapped = Gauge("vmemkv_num_requests_swapped", "Requests swapped out", registry=r)
        self.kv_usage = Gauge("vmemkv_kv_cache_usage_ratio", "Fraction of KV pages in use (0..1)",
                              registry=r)
        self.throughput = Gauge("vmemkv_generation_throughput_tokens_per_second",
                                f"Tokens generated per second over the last "
                                f"{_THROUGHPUT_WINDOW_S:g} s", registry=r)

    # ---- hooks the engine calls -------------------------------------------------------------

    def on_request_added(self, request_id: str, num_prompt_tokens: int,
                         now: float | None = None) -> None:
        now = _now(now)
        self._requests[request_id] = _RequestTimes(added=now)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.num_prompt_tokens += num_prompt_tokens
        if self._first_added is None:
            self._first_added = now

    def on_first_token(self, request_id: str, now: float | None = None) -> None:
        """The request's first output token exists (idempotent; ``on_step_tokens`` implies it)."""
        times = self._requests.get(request_id)
        if times is None or times.first_token is not None:
            return
        times.first_token = _now(now)
        self.ttft.observe(times.first_token - times.added)
        self.ttft_s.append(times.first_token - times.added)

    def on_step_tokens(self, counts: dict[str, int], now: float | None = None) -> None:
        """One step's output tokens, ``{request_id: n}`` (first tokens included): the shared
        counters and the throughput window are updated once per step, then each request's times."""
        total = sum(counts.values())
        if total <= 0:
            return
        now = _now(now)
        self.generation_tokens.inc(total)
        self.num_generation_tokens += total
        self._last_token = now
        self._recent_tokens.append((now, total))
        self._recent_token_count += total
        requests = self._requests
        for request_id, n in counts.items():
            times = requests.get(request_id)
            if times is None or n <= 0:
                continue
            if times.first_token is None:
                self.on_first_token(request_id, now)
            times.last_token = now
            times.num_generated += n

    def on_request_finished(self, request_id: str, reason: str, now: float | None = None) -> None:
        """The request ended: "stop", "length", "abort" or "error"."""
        now = _now(now)
        self.requests_finished.labels(finished_reason=reason).inc()
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        self.e2e_latency.observe(now - times.added)
        self.e2e_s.append(now - times.added)
        if times.num_generated > 1 and times.first_token is not None and times.last_token is not None:
            tpot = (times.last_token - times.first_token) / (times.num_generated - 1)
            self.tpot.observe(tpot)
            self.tpot_s.append(tpot)

    def on_step(self, num_running: int, num_waiting: int, num_swapped: int, kv_usage: float,
                num_preemptions_total: int, *, now: float | None = None) -> None:
        """Scheduler state after a step or an abort; ``num_preemptions_total`` is the engine's
        running total. (The prefix hit rate is read from ``cache_stats`` at scrape time.)"""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.swapped.set(num_swapped)
        self.kv_usage.set(kv_usage)
        if num_preemptions_total > self._preemptions_seen:  # a counter only moves forward
            self.preemptions.inc(num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = num_preemptions_total
        self.throughput.set(self._recent_throughput(_now(now)))

    # ---- reading ----------------------------------------------------------------------------

    def render(self) -> bytes:
        """All metrics in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def summary(self) -> dict:
        """Means and percentiles of the latency samples, token counts and overall throughput."""
        elapsed = None
        if self._first_added is not None and self._last_token is not None:
            elapsed = self._last_token - self._first_added
        throughput = self.num_generation_tokens / elapsed if elapsed else 0.0
        return {
            "num_requests_finished": dict(self.num_finished),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "ttft_s": _describe(list(self.ttft_s)),
            "tpot_s": _describe(list(self.tpot_s)),
            "e2e_latency_s": _describe(list(self.e2e_s)),
            "generation_throughput_tokens_per_s": throughput,
        }

    def _recent_throughput(self, now: float) -> float:
        while self._recent_tokens and self._recent_tokens[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent_token_count -= self._recent_tokens.popleft()[1]
        if self._first_added is None:
            return 0.0
        # Over the window, or over the time since the first request when that is shorter.
        span = min(_THROUGHPUT_WINDOW_S, now - self._first_added)
        return self._recent_token_count / span if span > 0 else 0.0


class _KVTimeExporter:
    """A Prometheus collector reading a KVMetricsCollector when scraped (nothing on the hot path)."""

    def __init__(self, kv_metrics: KVMetricsCollector) -> None:
        self.kv_metrics = kv_metrics

    def collect(self):
        snapshot = self.kv_metrics.snapshot()
        seconds = CounterMetricFamily(
            "vmemkv_kv_manager_seconds", "Seconds in KV cache manager operations (outermost "
            "calls, backend mapping inside them included), by operation", labels=["operation"])
        calls = CounterMetricFamily("vmemkv_kv_manager_calls",
                                    "KV cache manager operations (outermost calls), by operation",
                                    labels=["operation"])
        for name, op in sorted(snapshot["operations"].items()):
            seconds.add_metric([name], op["seconds"])
            calls.add_metric([name], op["calls"])
        map_seconds = CounterMetricFamily(
            "vmemkv_kv_mapping_seconds", "Seconds in the backend's map/unmap calls: inline (the "
            "step thread) or background (the lookahead worker)", labels=["where"])
        map_calls = CounterMetricFamily("vmemkv_kv_mapping_calls", "Backend map/unmap calls",
                                        labels=["where"])
        for where in ("inline", "background"):
            map_seconds.add_metric([where], snapshot[f"{where}_map_seconds"])
            map_calls.add_metric([where], snapshot[f"{where}_map_calls"])
        yield from (seconds, calls, map_seconds, map_calls)


class _PrefixCacheExporter:
    """A Prometheus collector reading the manager's prefix-cache counters when scraped."""

    def __init__(self, cache_stats: Callable[[], CacheStats]) -> None:
        self.cache_stats = cache_stats

    def collect(self):
        try:
            stats = self.cache_stats()
        except VmemkvError:  # the manager is closed: nothing to report
            return
        yield GaugeMetricFamily("vmemkv_prefix_cache_hit_rate", "Fraction of prompt tokens served "
                                "from the prefix cache at first admission (re-admissions after "
                                "preemption apart)", value=stats.prefix_hit_rate)
        hits = CounterMetricFamily("vmemkv_prefix_cache_hit_tokens", "Prompt tokens served from "
                                   "the prefix cache at first admission, by tier", labels=["tier"])
        hits.add_metric(["device"], stats.prefix_hit_tokens_device)
        hits.add_metric(["host"], stats.prefix_hit_tokens_host)
        hits.add_metric(["cold"], stats.prefix_hit_tokens_cold)
        yield hits
        copied = CounterMetricFamily("vmemkv_host_cache_copied_bytes", "Bytes the host tier copied, "
                                     "by direction", labels=["direction"])
        copied.add_metric(["to_host"], stats.host_bytes_demoted)
        copied.add_metric(["to_device"], stats.host_bytes_promoted)
        yield copied
        for name, value, text in (
                ("demotions", stats.host_demotions,
                 "Cached blocks evicted from the device pool and copied to the host tier"),
                ("promotions", stats.host_promotions,
                 "Host-tier blocks a prefix hit copied back into the device pool"),
                ("evictions", stats.host_evictions, "Blocks dropped from the host tier (LRU)")):
            yield CounterMetricFamily(f"vmemkv_host_cache_{name}", text, value=value)
        for name, value, text in (
                ("demotions", stats.cold_demotions, "Cached blocks compressed into the cold tier"),
                ("promotions", stats.cold_promotions,
                 "Cold-tier blocks a prefix hit decompressed into the device pool (lossy)"),
                ("evictions", stats.cold_evictions, "Blocks dropped from the cold tier (LRU)"),
                ("stored_bytes", stats.cold_bytes_stored, "Compressed bytes stored in the cold tier")):
            yield CounterMetricFamily(f"vmemkv_cold_cache_{name}", text, value=value)
        for name, value, text in (
                ("queried_tokens", stats.prefix_queried_tokens,
                 "Prompt tokens looked up in the prefix cache at first admission"),
                ("reprefill_queried_tokens", stats.reprefill_queried_tokens,
                 "Tokens looked up again when re-admitting a request preempted by recompute"),
                ("reprefill_hit_tokens", stats.reprefill_hit_tokens,
                 "Of those, tokens served from the prefix cache (not in the hit rate)"),
                ("partial_page_tokens", stats.prefix_partial_page_tokens,
                 "Prompt tokens a cached page shared past the page hits, not served because the "
                 "shared part is shorter than a page")):
            yield CounterMetricFamily(f"vmemkv_prefix_cache_{name}", text, value=value)
        yield CounterMetricFamily("vmemkv_kv_blocks_released_behind_window", "KV blocks given back "
                                  "while their request ran, wholly behind its sliding window",
                                  value=stats.blocks_released_behind_window)


class _KVMemoryExporter:
    """Elastic KV memory when scraped: resident bytes, blocks given back and taken again, and the
    shared KV budget (``kv_pool``): its size, every engine's use, this engine's share."""

    GAUGES = (("kv_bytes_resident", "vmemkv_kv_resident_bytes", "Bytes of KV blocks with memory behind them"),
              ("kv_pool_bytes", "vmemkv_kv_pool_bytes", "Bytes of the shared KV budget"),
              ("kv_pool_used_bytes", "vmemkv_kv_pool_used_bytes", "Bytes of the shared KV budget "
               "every engine holds"),
              ("kv_pool_share_bytes", "vmemkv_kv_pool_share_bytes", "Bytes of the shared KV budget "
               "this engine holds"))
    COUNTERS = (("blocks_given_back", "vmemkv_kv_blocks_given_back", "KV blocks whose memory went back"),
                ("blocks_taken_again", "vmemkv_kv_blocks_taken_again", "KV blocks given back, then "
                 "written again"))

    def __init__(self, memory_stats: Callable[[], dict]) -> None:
        self.memory_stats = memory_stats

    def collect(self):
        try:
            stats = self.memory_stats()
        except VmemkvError:  # the manager is closed: nothing to report
            return
        for key, name, text in self.GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, text, value=stats[key])
        for key, name, text in self.COUNTERS:
            yield CounterMetricFamily(name, text, value=stats[key])


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


def _describe(samples: list[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"count": 0, "mean": None, "p50": None, "p99": None}
    samples.sort()
    return {"count": len(samples), "mean": sum(samples) / len(samples),
            "p50": percentile(samples, 50), "p99": percentile(samples, 99)}


def percentile(sorted_samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted samples, linearly interpolated (numpy's default)."""
    position = (len(sorted_samples) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(sorted_samples) - 1)
    return sorted_samples[low] + (sorted_samples[high] - sorted_samples[low]) * (position - low)
