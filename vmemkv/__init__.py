"""vmemkv: a KV-cache memory manager on virtual-memory page mapping.

Each request's KV cache is virtually contiguous (attention kernels read it without a block table)
while physical pages come from a reference-counted pool with prefix caching, copy-on-write and
preemption. See README.md for the API.
"""

from vmemkv import _moved
from vmemkv._lazy import lazy_exports
from vmemkv.errors import (BlockStateError, ConfigError, CudaDriverError, InvalidInputError,
                           InvalidStateError, ManagerClosedError, MappingError, MappingLimitError,
                           NativeExtensionError, OutOfBlocksError, RequestStateError, RequestTooLongError,
                           UnsupportedModelError, VmemkvError)
from vmemkv.errors import deprecated_name as _deprecated_name

_moved.install()  # the modules' paths before the concept folders, for one release

# The rest of the public API, imported on first use: `import vmemkv` (and `vmemkv --help`) loads
# no torch. Name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(("CacheKeys", "MultimodalItem"), "vmemkv.cache.hashing"),
    **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
                     "KVEventBuffer"), "vmemkv.cache.events"),
    "KVMetricsCollector": "vmemkv.cache.metrics",
    "KVLayout": "vmemkv.memory.layout",
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


def _hybrid_manager(config, layer_windows, chunk_tokens=None, local_blocks=None, metrics=None,
                    backends=None, events=None) -> "KVCacheManager":
    """``HybridKVCacheManager(...)`` as it was called before 0.2."""
    manager = __getattr__("KVCacheManager")
    return manager(config, metrics=metrics, events=events, layer_windows=layer_windows,
                   chunk_tokens=chunk_tokens, local_blocks=local_blocks, backends=backends)


_lazy_getattr, _lazy_dir = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return _lazy_getattr(name)
    if name == "PagePool":  # the pre-0.2 name of BlockPool, kept for one release
        import warnings
        warnings.warn("vmemkv.PagePool is deprecated; use vmemkv.BlockPool", DeprecationWarning,
                      stacklevel=2)
        return __getattr__("BlockPool")
    if name == "HybridKVCacheManager":  # before 0.2: a second manager; now KVCacheManager's groups
        import warnings
        warnings.warn("vmemkv.HybridKVCacheManager is deprecated; use vmemkv.KVCacheManager(config, "
                      "layer_windows=...)", DeprecationWarning, stacklevel=2)
        return _hybrid_manager
    if name in ("OutOfPagesError", "PageStateError"):  # the pre-0.2 names, kept for one release
        return _deprecated_name(__name__, name)
    # The engine pulls in transformers; load it only when asked for.
    if name in _ENGINE_NAMES:
        from vmemkv import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'vmemkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(_lazy_dir()) | _ENGINE_NAMES)
