"""The A/B harness (``vmemkv ab``): the same engine, model and requests with the KV cache either
virtually contiguous (vmem, token-major or per-layer) or in block tables (paged), side by side;
on sliding-window models also keeping every block (vmem-keep, paged-keep)."""

from vmemkv._lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("METRIC_KEYS", "run_experiment", "run_once"), "vmemkv.ab.runner"),
            "VARIANTS": "vmemkv.ab.variants",
            **dict.fromkeys(("WORKLOADS", "Workload", "make_workload"), "vmemkv.ab.workloads")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
