"""vmemkv: a KV-cache memory manager on virtual-memory page mapping.

Each request's KV cache is virtually contiguous (attention kernels read it without a block table)
while physical pages come from a reference-counted pool with prefix caching, copy-on-write and
preemption. See README.md for the API.
"""

from vmemkv._lazy import lazy_exports
from vmemkv.errors import (BlockStateError, ConfigError, CudaDriverError, InvalidInputError,
                           InvalidStateError, ManagerClosedError, MappingError, MappingLimitError,
                           NativeExtensionError, OutOfBlocksError, RequestStateError, RequestTooLongError,
                           UnsupportedModelError, VmemkvError)

# The rest of the public API, imported on first use: `import vmemkv` (and `vmemkv --help`) loads
# no torch. Name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(("CacheKeys", "MultimodalItem"), "vmemkv.cache.hashing"),
    **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
                     "KVEventBuffer"), "vmemkv.cache.events"),
    "KVMetricsCollector": "vmemkv.cache.metrics",
    "KVLayout": "vmemkv.memory.layout",
    # the kinds of KV memory (one group class per kind: cache/coordinator.py)
    **dict.fromkeys(("KVCacheSpec", "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalSpec",
                     "MLALatentSpec", "RecurrentStateSpec", "StatePart", "NO_MEMORY"),
                   "vmemkv.cache.kv_spec"),
    **dict.fromkeys(("CacheConfig", "CacheStats", "PreemptionEstimate"), "vmemkv.cache.config"),
    **dict.fromkeys(("KVCacheManager", "PrefixCacheBusyError", "UnknownRequestError",
                     "WrongRequestStateError"), "vmemkv.cache.manager"),
    "Refusal": "vmemkv.cache.refusal",
    "slot_attention": "vmemkv.engine.core.addressing",
    "BlockPool": "vmemkv.cache.pool",
    "KVRequest": "vmemkv.cache.request",
    "NoFreeSlotError": "vmemkv.memory.slots",
    "OutOfSwapSpaceError": "vmemkv.cache.swap",
}

__version__ = "0.1.0"

_ENGINE_NAMES = {"LLM", "SamplingParams", "EngineConfig"}


_lazy_getattr, _lazy_dir = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return _lazy_getattr(name)
    # The engine pulls in transformers; load it only when asked for.
    if name in _ENGINE_NAMES:
        from vmemkv import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'vmemkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(_lazy_dir()) | _ENGINE_NAMES)
