"""The A/B harness (``vmemkv ab``): the same engine, model and requests with the KV cache either
virtually contiguous (vmem, token-major or per-layer) or in block tables (paged), side by side;
on sliding-window models also keeping every block (vmem-keep, paged-keep)."""

from vmemkv.ab.runner import METRIC_KEYS, run_experiment, run_once
from vmemkv.ab.variants import VARIANTS
from vmemkv.ab.workloads import WORKLOADS, Workload, make_workload

__all__ = ["METRIC_KEYS", "VARIANTS", "WORKLOADS", "Workload", "make_workload", "run_experiment",
           "run_once"]
